"""`nemotron-loadtest` / `python -m loadtest`: run, sweep, profiles, report, schema, overhead.

    run       one load shape against any OpenAI-compatible endpoint
    sweep     a list of concurrencies or rates, the same workload at each
    profiles  per engine profile: start the engine through the supervisor, wait ready, measure, stop
    report    redraw report.md and the charts from a saved results.json
    schema    print the JSON Schema of results.json
    overhead  the gateway-overhead benchmark (`make bench`; its own flags)

`run`, `sweep` and `profiles` send their load with vLLM's benchmark client (`vllm bench serve`, one process per
point: `loadtest/points.py`); the flags map onto its own (loadtest/README.md). It imports nothing of `gateway`:
targets are spoken to over HTTP, the supervisor runs as a child process.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import logging
import os
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import orjson

from loadtest import overhead
from loadtest.engine import EngineLaunch, EngineStartError, SupervisedEngine, wait_http
from loadtest.points import (
    DEFAULT_REQUESTS,
    PointError,
    Shape,
    Target,
    TargetError,
    Workload,
    client_version,
    fetch_model,
    measure,
)
from loadtest.processes import free_port
from loadtest.report import build_document, points_table, profiles_table, write_outputs
from loadtest.schema import RESULTS_SCHEMA, SCHEMA_VERSION

logger = logging.getLogger("loadtest")

DEFAULT_STATE_DIR = Path("/tmp/nemotron-loadtest/engine")
DEFAULT_OUTPUT_LEN = 64


def _workload_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workload (sent by vLLM's benchmark client, `vllm bench serve`)")
    group.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="Bearer key (env OPENAI_API_KEY)")
    group.add_argument("--model", help="model name to send (default: the first id of GET /v1/models)")
    group.add_argument("--tokenizer", help="tokenizer directory or id: makes and counts the prompts")
    group.add_argument("--endpoint", choices=["chat", "completions"], default="chat", help="always streamed")
    group.add_argument(
        "--requests", type=int, help=f"requests per point (default {DEFAULT_REQUESTS}; open loop: rate x duration)"
    )
    group.add_argument("--duration", type=float, default=120.0, help="seconds per point: the time box (see README)")
    group.add_argument("--warmup", type=int, default=4, help="requests sent first at each point, not measured")
    group.add_argument("--prompts", type=Path, help='JSONL file, {"prompt": ..., "output_tokens": N} per line')
    group.add_argument("--input-len", type=int, default=128, help="random prompts: tokens each")
    group.add_argument("--max-tokens", type=int, help=f"output tokens asked (default {DEFAULT_OUTPUT_LEN}; a prompts "
                       "file: each line's output_tokens)")  # fmt: skip
    group.add_argument("--range-ratio", type=float, default=0.0, help="random lengths in [N(1-R), N(1+R)]")
    group.add_argument("--temperature", type=float, default=0.0)
    group.add_argument("--ignore-eos", action="store_true", help="vLLM: always generate max_tokens")
    group.add_argument("--seed", type=int, default=0, help="prompts and arrivals; sweep point k uses seed + k")
    group.add_argument("--slo-ttft", type=float, metavar="MS", help="goodput: time-to-first-token objective")
    group.add_argument("--slo-latency", type=float, metavar="MS", help="goodput: end-to-end latency objective")
    group.add_argument("--no-metrics", action="store_true", help="do not scrape the target's /metrics")
    group.add_argument("--out", type=Path, help="write results.json, report.md, PNG charts and vLLM's results here")


def _shape_arguments(parser: argparse.ArgumentParser, *, levels: bool) -> None:
    shape = parser.add_mutually_exclusive_group(required=levels)
    if levels:
        shape.add_argument("--concurrency", help="closed loop, comma-separated, e.g. 1,2,4,8")
        shape.add_argument("--rate", help="open loop, comma-separated requests/s, e.g. 0.5,1,2")
    else:
        shape.add_argument("--concurrency", type=int, help="closed loop: requests in flight (default 1)")
        shape.add_argument("--rate", type=float, help="open loop: arrivals per second")
    parser.add_argument("--max-concurrency", type=int, help="open loop: cap on requests in flight")
    parser.add_argument("--burstiness", type=float, default=1.0, help="open loop: 1 Poisson, <1 burstier (gamma)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    parser = argparse.ArgumentParser(prog="nemotron-loadtest", description=__doc__.splitlines()[0])
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="COMMAND")
    run = verbs.add_parser("run", help="one load shape against an OpenAI-compatible endpoint")
    run.add_argument("--base-url", required=True, help="http://host:port or http://host:port/v1")
    _shape_arguments(run, levels=False)
    _workload_arguments(run)

    sweep = verbs.add_parser("sweep", help="the same workload at several concurrencies or rates")
    sweep.add_argument("--base-url", required=True)
    _shape_arguments(sweep, levels=True)
    _workload_arguments(sweep)

    profiles = verbs.add_parser("profiles", help="per engine profile: start through the supervisor, measure, stop")
    profiles.add_argument("--profiles", required=True, help="comma-separated profile names")
    profiles.add_argument("--model-path", help="model directory or hub id (else NEMOTRON_ENGINE__MODEL)")
    profiles.add_argument("--profiles-file", type=Path, help="operator profiles TOML (NEMOTRON_ENGINE__PROFILES_FILE)")
    profiles.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR, help="supervisor status + flag cache")
    profiles.add_argument("--engine-port", type=int, help="engine port (default: a free one; fixed with a gateway)")
    profiles.add_argument("--gateway-url", help="measure through this gateway (its engine URL = the engine port)")
    profiles.add_argument("--start-timeout", type=float, default=900.0, help="seconds for an engine to be ready")
    _shape_arguments(profiles, levels=False)
    _workload_arguments(profiles)

    report = verbs.add_parser("report", help="redraw report.md and charts from a results.json")
    report.add_argument("results", type=Path, help="results.json, or the directory holding it")
    verbs.add_parser("schema", help="print the JSON Schema of results.json")
    verbs.add_parser("overhead", help="gateway overhead vs the engine directly (see `overhead --help`)")
    return parser


def parse_list(text: str, kind: type[int] | type[float]) -> list[float]:
    """`1,2, 4` → [1, 2, 4]: every value positive."""
    try:
        values = [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"not a comma-separated list of numbers: {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"every level must be positive: {text!r}")
    return values


def _shapes(args: argparse.Namespace) -> list[Shape]:
    """The load shapes of `run`, `sweep` or `profiles`; ValueError for a bad combination."""
    cap = args.max_concurrency
    if cap is not None and cap < 1:
        raise ValueError("--max-concurrency must be at least 1")
    if args.rate is None and (cap is not None or args.burstiness != 1.0):
        raise ValueError("--max-concurrency and --burstiness shape an open loop: use them with --rate")
    if args.burstiness <= 0:
        raise ValueError("--burstiness must be positive")
    if args.verb == "sweep":
        if args.concurrency is not None:
            return [Shape(concurrency=int(c)) for c in parse_list(args.concurrency, int)]
        return [Shape(rate=r, max_concurrency=cap) for r in parse_list(args.rate, float)]
    if args.rate is not None:
        if args.rate <= 0:
            raise ValueError("--rate must be positive")
        return [Shape(rate=args.rate, max_concurrency=cap)]
    if args.concurrency is not None and args.concurrency < 1:
        raise ValueError("--concurrency must be at least 1")
    return [Shape(concurrency=args.concurrency or 1)]


def check_prompts_file(path: Path, *, output_tokens_needed: bool) -> None:
    """What vLLM's custom dataset reads: a `.jsonl` file, a JSON object per line with a string "prompt" (and an
    integer "output_tokens" unless --max-tokens is given). ValueError naming the first bad line."""
    if path.suffix != ".jsonl":
        raise ValueError(f"{path}: vLLM's custom dataset reads only files named *.jsonl")
    lines = path.read_text().splitlines()
    if not any(line.strip() for line in lines):
        raise ValueError(f"{path}: no prompts")
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError:
            raise ValueError(f"{path}:{number}: not JSON") from None
        if not isinstance(item, dict):
            raise ValueError(f"{path}:{number}: not a JSON object")
        if not isinstance(item.get("prompt"), str):
            raise ValueError(f'{path}:{number}: needs a string "prompt" (vLLM\'s custom dataset has no "messages")')
        tokens = item.get("output_tokens")
        if output_tokens_needed and (not isinstance(tokens, int) or tokens < 1):
            raise ValueError(f'{path}:{number}: needs "output_tokens" (a positive integer) without --max-tokens')


def _workload(args: argparse.Namespace, model: str, tokenizer: str) -> Workload:
    """The workload from the flags; ValueError for a bad value."""
    if args.requests is not None and args.requests < 1:
        raise ValueError("--requests must be at least 1")
    if args.duration <= 0 or args.warmup < 0:
        raise ValueError("--duration must be positive, --warmup not negative")
    if args.input_len < 1 or (args.max_tokens is not None and args.max_tokens < 1):
        raise ValueError("--input-len and --max-tokens must be at least 1")
    if not 0 <= args.range_ratio < 1:
        raise ValueError("--range-ratio must be in [0, 1)")
    if args.prompts is not None:
        check_prompts_file(args.prompts, output_tokens_needed=args.max_tokens is None)
        if importlib.util.find_spec("pandas") is None:
            raise ValueError("vLLM's custom dataset reads a prompts file with pandas: install the `loadtest` extra")
    output_len = args.max_tokens if args.max_tokens is not None or args.prompts else DEFAULT_OUTPUT_LEN
    return Workload(
        model=model,
        tokenizer=tokenizer,
        endpoint=args.endpoint,
        input_len=args.input_len,
        output_len=output_len,
        range_ratio=args.range_ratio,
        prompts_file=args.prompts,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        seed=args.seed,
        requests=args.requests,
        duration_s=args.duration,
        warmup=args.warmup,
        burstiness=args.burstiness,
        slo_ttft_ms=args.slo_ttft,
        slo_e2el_ms=args.slo_latency,
    )


def _tokenizer(args: argparse.Namespace, model: str, fallback: str | None = None) -> str:
    """--tokenizer, else `fallback` (profiles: the model path), else the model name when it is a local directory."""
    tokenizer = args.tokenizer or fallback or (model if Path(model).is_dir() else None)
    if tokenizer is None:
        raise ValueError(
            f"--tokenizer is needed: vLLM's client makes and counts the prompts with the model's tokenizer, and the "
            f"model name {model!r} is not a local directory"
        )
    return tokenizer


@contextlib.contextmanager
def _work_dir(out: Path | None) -> Iterator[Path]:
    """Where vLLM's client saves each point's result and log: OUT/vllm, else a directory removed afterwards."""
    if out is not None:
        yield out / "vllm"
        return
    with tempfile.TemporaryDirectory(prefix="nemotron-loadtest-") as work:
        yield Path(work)


def _require_client() -> None:
    """ValueError unless vLLM (whose benchmark client sends the load) is installed; read without importing it."""
    if client_version() is None:
        raise ValueError("vLLM's benchmark client sends the load: install vLLM (the `cpu` or the `gpu` extra)")


def run_points(args: argparse.Namespace) -> dict[str, Any]:
    """`run` and `sweep`: every shape against the one target, point k with seed + k (fresh prompts each point, so
    the server's prefix cache does not carry one point's prompts into the next)."""
    _require_client()
    shapes = _shapes(args)
    target = Target.from_url(args.base_url, args.api_key, scrape_metrics=not args.no_metrics)
    model = args.model or fetch_model(target)
    workload = _workload(args, model, _tokenizer(args, model))
    points: list[dict[str, Any]] = []
    failures: dict[str, str] = {}
    with _work_dir(args.out) as work:
        for number, shape in enumerate(shapes):
            try:
                point = measure(target, workload, shape, seed=workload.seed + number, work=work, label=shape.label)
            except PointError as exc:
                logger.error("%s: %s", shape.label, exc)
                failures[shape.label] = str(exc)[-2000:]
                continue
            logger.info("%s: %d ok of %d", shape.label, point["summary"]["completed"], point["num_prompts"])
            points.append(point)
    return build_document(
        args.verb, base_url=target.base_url, model=model, via=None, workload=workload, points=points, failures=failures
    )


def run_profiles(args: argparse.Namespace) -> dict[str, Any]:
    """`profiles`: one point per profile, each on a freshly started engine, the same requests (one seed) for all."""
    _require_client()
    names = [name.strip() for name in args.profiles.split(",") if name.strip()]
    if args.gateway_url and args.engine_port is None:
        raise ValueError("--gateway-url needs --engine-port: the gateway's engine URL must point at it")
    [shape] = _shapes(args)
    model_path = args.model_path or os.environ.get("NEMOTRON_ENGINE__MODEL")
    # Checked before any engine starts; the model's name is then the one the engine serves.
    workload = _workload(args, args.model or "", _tokenizer(args, args.model or "", fallback=model_path))
    points: list[dict[str, Any]] = []
    failures: dict[str, str] = {}
    # Through a gateway, every profile's point has the gateway's URL; straight to the engines, each its own port.
    base_url = Target.from_url(args.gateway_url).base_url if args.gateway_url else ""
    with _work_dir(args.out) as work:
        for name in names:
            launch = EngineLaunch(
                profile=name,
                port=args.engine_port or free_port(),
                state_dir=args.state_dir,
                model_path=args.model_path,
                profiles_file=args.profiles_file,
                start_timeout=args.start_timeout,
            )
            logger.info("profile %s: starting the engine on %s", name, launch.url)
            try:
                with SupervisedEngine(launch):
                    target = Target.from_url(
                        args.gateway_url or launch.url, args.api_key, scrape_metrics=not args.no_metrics
                    )
                    if args.gateway_url:
                        wait_http(target.base_url + "/ready", within=120.0)
                    workload = dataclasses.replace(workload, model=args.model or fetch_model(target))
                    points.append(
                        measure(target, workload, shape, seed=workload.seed, work=work, label=name, profile=name)
                    )
            except (EngineStartError, TargetError, PointError, TimeoutError) as exc:
                logger.error("profile %s: %s", name, exc)
                failures[name] = str(exc)[-2000:]
    return build_document(
        "profiles",
        base_url=base_url,
        model=workload.model,
        via="gateway" if args.gateway_url else "engine",
        workload=workload,
        points=points,
        failures=failures,
    )


def _finish(document: dict[str, Any], out: Path | None) -> None:
    table = profiles_table(document) if document["kind"] == "profiles" else points_table(document)
    sys.stdout.write(table)
    if out is not None:
        for path in write_outputs(document, out):
            logger.info("wrote %s", path)


def _redraw(path: Path) -> int:
    results = path / "results.json" if path.is_dir() else path
    document = orjson.loads(results.read_bytes())
    version = document.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ValueError(f"{results}: schema_version {version}, this tool draws {SCHEMA_VERSION}: measure again")
    for written in write_outputs(document, results.parent):
        logger.info("wrote %s", written)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `nemotron-loadtest` and `python -m loadtest`."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["overhead"]:
        return overhead.main(args_list[1:])
    args = build_parser().parse_args(args_list)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        if args.verb == "schema":
            sys.stdout.write(orjson.dumps(RESULTS_SCHEMA, option=orjson.OPT_INDENT_2).decode() + "\n")
            return 0
        if args.verb == "report":
            return _redraw(args.results)
        document = run_profiles(args) if args.verb == "profiles" else run_points(args)
        _finish(document, args.out)
        return 1 if document["failures"] else 0
    except (ValueError, TargetError, OSError) as exc:
        sys.stderr.write(f"nemotron-loadtest: {exc}\n")
        return 2
