"""`nemotron-loadtest` / `python -m loadtest`: run, sweep, profiles, report, schema, overhead.

    run       one load shape against any OpenAI-compatible endpoint
    sweep     a list of concurrencies or rates, the same workload at each
    profiles  per engine profile: start the engine through the supervisor, wait ready, measure, stop
    report    redraw report.md and the charts from a saved results.json
    schema    print the JSON Schema of results.json
    overhead  the gateway-overhead benchmark (`make bench`; its own flags)

Of `gateway` imports only the process runner (`gateway.supervisor.process`): targets are spoken to over HTTP, the
supervisor runs as a child process.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from loadtest import overhead
from loadtest.engine import EngineLaunch, EngineStartError, SupervisedEngine, wait_http
from loadtest.processes import free_port
from loadtest.report import build_document, points_table, profiles_table, write_outputs
from loadtest.runner import LoadShape, Plan, Point, Target, TargetError, fetch_model, run_point
from loadtest.schema import RESULTS_SCHEMA
from loadtest.summary import Objectives
from loadtest.traffic import (
    DISTRIBUTIONS,
    FilePrompts,
    PromptFileError,
    SyntheticPrompts,
    Traffic,
    parse_list,
    parse_token_range,
)

logger = logging.getLogger("loadtest")

# Sweep point k numbers its requests from k * POINT_STRIDE: fresh prompts from the same distribution, so a
# server's prefix cache does not carry one point's prompts into the next.
POINT_STRIDE = 1_000_000
DEFAULT_STATE_DIR = Path("/tmp/nemotron-loadtest/engine")


def _workload_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workload")
    group.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="Bearer key (env OPENAI_API_KEY)")
    group.add_argument("--model", help="model name to send (default: the first id of GET /v1/models)")
    group.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    group.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True, help="streamed answers")
    group.add_argument("--requests", type=int, default=100, help="measured requests per point (an upper bound)")
    group.add_argument("--duration", type=float, default=120.0, help="seconds per point (an upper bound)")
    group.add_argument("--warmup", type=int, default=4, help="requests sent first at each point, not measured")
    group.add_argument("--prompts", type=Path, help='JSONL file: {"prompt": ...} or {"messages": [...]} per line')
    group.add_argument("--prompt-tokens-mean", type=float, default=128.0, help="synthetic prompt length (words)")
    group.add_argument("--prompt-tokens-stddev", type=float, default=32.0)
    group.add_argument("--prompt-distribution", choices=DISTRIBUTIONS, default="normal")
    group.add_argument("--max-tokens", default="64", help="N, or LOW:HIGH drawn uniformly per request")
    group.add_argument("--temperature", type=float, default=0.0)
    group.add_argument("--ignore-eos", action="store_true", help="vLLM: always generate max_tokens")
    group.add_argument("--seed", type=int, default=0, help="prompts, lengths and arrivals follow from it")
    group.add_argument("--slo-ttft", type=float, metavar="MS", help="goodput: time-to-first-token objective")
    group.add_argument("--slo-latency", type=float, metavar="MS", help="goodput: end-to-end latency objective")
    group.add_argument("--timeout", type=float, default=300.0, help="seconds one request may take")
    group.add_argument("--no-metrics", action="store_true", help="do not scrape the target's /metrics")
    group.add_argument("--out", type=Path, help="write results.json, report.md and PNG charts here")
    group.add_argument("--quiet", action="store_true", help="no progress bar")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    parser = argparse.ArgumentParser(prog="nemotron-loadtest", description=__doc__.splitlines()[0])
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="COMMAND")
    run = verbs.add_parser("run", help="one load shape against an OpenAI-compatible endpoint")
    run.add_argument("--base-url", required=True, help="http://host:port or http://host:port/v1")
    shape = run.add_mutually_exclusive_group()
    shape.add_argument("--concurrency", type=int, help="closed loop: requests in flight (default 1)")
    shape.add_argument("--rate", type=float, help="open loop: Poisson arrivals per second")
    run.add_argument("--max-concurrency", type=int, help="open loop: cap on requests in flight")
    _workload_arguments(run)

    sweep = verbs.add_parser("sweep", help="the same workload at several concurrencies or rates")
    sweep.add_argument("--base-url", required=True)
    levels = sweep.add_mutually_exclusive_group(required=True)
    levels.add_argument("--concurrency", help="comma-separated, e.g. 1,2,4,8")
    levels.add_argument("--rate", help="comma-separated requests/s, e.g. 0.5,1,2")
    sweep.add_argument("--max-concurrency", type=int, help="open loop: cap on requests in flight")
    _workload_arguments(sweep)

    profiles = verbs.add_parser("profiles", help="per engine profile: start through the supervisor, measure, stop")
    profiles.add_argument("--profiles", required=True, help="comma-separated profile names")
    profiles.add_argument("--model-path", help="model directory or hub id (else NEMOTRON_ENGINE__MODEL)")
    profiles.add_argument("--profiles-file", type=Path, help="operator profiles TOML (NEMOTRON_ENGINE__PROFILES_FILE)")
    profiles.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR, help="supervisor status + flag cache")
    profiles.add_argument("--engine-port", type=int, help="engine port (default: a free one; fixed with a gateway)")
    profiles.add_argument("--gateway-url", help="measure through this gateway (its engine URL = the engine port)")
    profiles.add_argument("--start-timeout", type=float, default=900.0, help="seconds for an engine to be ready")
    profile_shape = profiles.add_mutually_exclusive_group()
    profile_shape.add_argument("--concurrency", type=int, help="closed loop (default 1)")
    profile_shape.add_argument("--rate", type=float, help="open loop: Poisson arrivals per second")
    profiles.add_argument("--max-concurrency", type=int)
    _workload_arguments(profiles)

    report = verbs.add_parser("report", help="redraw report.md and charts from a results.json")
    report.add_argument("results", type=Path, help="results.json, or the directory holding it")
    verbs.add_parser("schema", help="print the JSON Schema of results.json")
    verbs.add_parser("overhead", help="gateway overhead vs the engine directly (see `overhead --help`)")
    return parser


def _traffic(args: argparse.Namespace, model: str) -> Traffic:
    prompts: SyntheticPrompts | FilePrompts
    if args.prompts is not None:
        prompts = FilePrompts.load(args.prompts)
    else:
        prompts = SyntheticPrompts(args.prompt_tokens_mean, args.prompt_tokens_stddev, args.prompt_distribution)
    return Traffic(
        model=model,
        endpoint=args.endpoint,
        stream=args.stream,
        prompts=prompts,
        max_tokens=parse_token_range(args.max_tokens),
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        seed=args.seed,
    )


def _plan(args: argparse.Namespace) -> Plan:
    if args.requests < 1 or args.duration <= 0 or args.warmup < 0 or args.timeout <= 0:
        raise ValueError("--requests and --duration must be positive, --warmup not negative")
    return Plan(
        requests=args.requests,
        duration=args.duration,
        warmup=args.warmup,
        timeout=args.timeout,
        objectives=Objectives(ttft_ms=args.slo_ttft, latency_ms=args.slo_latency),
        progress=not args.quiet,
    )


def _shapes(args: argparse.Namespace) -> list[LoadShape]:
    cap = args.max_concurrency
    if args.verb == "sweep":
        if args.concurrency is not None:
            return [LoadShape(concurrency=c) for c in parse_list(args.concurrency, int)]
        return [LoadShape(rate=r, max_concurrency=cap) for r in parse_list(args.rate, float)]
    if args.rate is not None:
        if args.rate <= 0:
            raise ValueError("--rate must be positive")
        return [LoadShape(rate=args.rate, max_concurrency=cap)]
    if args.concurrency is not None and args.concurrency < 1:
        raise ValueError("--concurrency must be at least 1")
    return [LoadShape(concurrency=args.concurrency or 1)]


def run_points(args: argparse.Namespace) -> dict[str, Any]:
    """`run` and `sweep`: every shape against the one target."""
    target = Target.from_url(args.base_url, args.api_key, scrape_metrics=not args.no_metrics)
    model = args.model or asyncio.run(fetch_model(target))
    traffic, plan = _traffic(args, model), _plan(args)
    points: list[Point] = []
    for number, shape in enumerate(_shapes(args)):
        point = asyncio.run(run_point(target, traffic, shape, plan, first_index=number * POINT_STRIDE))
        logger.info("%s: %d ok of %d", point.label, point.summary.ok, point.summary.requests)
        points.append(point)
    return build_document(
        args.verb, base_url=target.base_url, model=model, via=None, traffic=traffic, plan=plan, points=points
    )


def run_profiles(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, str]]:
    """`profiles`: one point per profile, each on a freshly started engine; also the profiles that failed."""
    names = [name.strip() for name in args.profiles.split(",") if name.strip()]
    if args.gateway_url and args.engine_port is None:
        raise ValueError("--gateway-url needs --engine-port: the gateway's engine URL must point at it")
    plan = _plan(args)
    shape = _shapes(args)[0]
    points: list[Point] = []
    failures: dict[str, str] = {}
    traffic: Traffic | None = None
    base_url = ""
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
                    wait_http(target.url("/ready"), within=120.0)
                model = args.model or asyncio.run(fetch_model(target))
                traffic = traffic or _traffic(args, model)
                points.append(asyncio.run(run_point(target, traffic, shape, plan, profile=name)))
                base_url = target.base_url
        except (EngineStartError, TargetError, TimeoutError) as exc:
            logger.error("profile %s: %s", name, exc)
            failures[name] = str(exc)[-2000:]
    if traffic is None:
        traffic = _traffic(args, args.model or "")
    document = build_document(
        "profiles",
        base_url=base_url,
        model=traffic.model,
        via="gateway" if args.gateway_url else "engine",
        traffic=traffic,
        plan=plan,
        points=points,
    )
    document["failures"] = failures
    return document, failures


def _finish(document: dict[str, Any], out: Path | None) -> None:
    table = profiles_table(document) if document["kind"] == "profiles" else points_table(document)
    sys.stdout.write(table)
    if out is not None:
        for path in write_outputs(document, out):
            logger.info("wrote %s", path)


def _redraw(path: Path) -> int:
    results = path / "results.json" if path.is_dir() else path
    document = orjson.loads(results.read_bytes())
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
        if args.verb == "profiles":
            document, failures = run_profiles(args)
            _finish(document, args.out)
            return 1 if failures else 0
        _finish(run_points(args), args.out)
        return 0
    except (ValueError, PromptFileError, TargetError, OSError) as exc:
        sys.stderr.write(f"nemotron-loadtest: {exc}\n")
        return 2
