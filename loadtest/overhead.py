"""The gateway's overhead: one workload sent directly to a stub engine and through the gateway, interleaved.

The gateway runs pinned to core 0; the stub engine and this process (the load generator) share core 1.
nginx, when installed, proxies the same workload from core 0 as the reference: a C proxy's cost for the
same bytes, so every run prints the gateway's cost per chunk as a multiple of nginx's.
Reports medians across rounds: latency direct vs gateway, saturation requests/s, and the gateway's own
CPU time per request and per relayed chunk from each process's CPU-time clock. Imports nothing from `gateway`.

    python -m loadtest.overhead [--duration S] [--rounds K] [--concurrency 1 32] [--json OUT]
    python -m loadtest.overhead --lean [--auth]     # access log off, one worker, no keys (--auth: keys on)
    python -m loadtest.overhead --no-nginx          # without the nginx reference
    python -m loadtest.overhead --tracing           # tracing off, on at 100 % and at 1 %, in the same rounds

By default the gateway runs with the settings a user runs: no NEMOTRON_* variable but the engine and Redis
URLs, so the access log is on (info level), the worker count is its default (one per usable CPU: one under
the bench's one-core pin, two with `--no-pin` on a 2-core machine) and keys and limits are on: a real key
admitted through the Redis limiter on every request (limits high enough never to refuse). `--lean` is the
relay alone. CPU is summed over the gateway's process and its forked workers. Without `--redis-url` a
private redis-server is started (on core 1, with the engine).

`--tracing` measures two more gateways of this tree in the same rounds, with OpenTelemetry tracing on (the OTEL_*
variables) and sampled at 100 % and at 1 %, exporting to an OTLP sink on core 1 (`loadtest/otlp_sink.py`); the
plain gateway is tracing off. Each is summarized as the gateway; the spans each exported and dropped are reported.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import orjson

from loadtest.nginx import nginx_binary, nginx_process
from loadtest.phases import (
    CpuMeter,
    PhaseRecord,
    Workload,
    chunk_cost_ratio,
    chunk_cost_us,
    median,
    pick,
    records_json,
    run_phase,
)
from loadtest.processes import (
    BenchProcess,
    can_pin,
    free_port,
    pin_self,
    python_argv,
    redis_process,
    revision,
    wait_redis,
)

GATEWAY, ENGINE, NGINX = "gateway", "engine", "nginx"
# A second gateway from another source tree (`--baseline DIR`), measured in the same rounds: before and after a
# change under the same noise.
BASELINE = "baseline"
# Gateways of this tree with tracing on, sampled at these ratios (`--tracing`), measured in the same rounds.
TRACED = {"traced-100": "1", "traced-1": "0.01"}
_GATEWAYS = (GATEWAY, BASELINE, *TRACED)
SINK = "otlp-sink"
# Tracing's settings besides the sampler: the sink, and a schedule delay short enough that a phase's spans are
# exported (and their CPU counted) within the phase rather than during the next target's.
TRACING_ENV = {"OTEL_BSP_SCHEDULE_DELAY": "200", "OTEL_TRACES_SAMPLER": "parentbased_traceidratio"}
# Seconds between two phases with tracing on: the last spans of a traced phase go out before the next phase starts.
TRACING_SETTLE = 0.5
DIRECT = "direct"
# The overhead targets (README, "Performance"); a request with a key and the Redis limiter may cost up to
# `ms_per_request_auth`.
TARGETS = {
    "ms_per_request": 0.6,
    "ms_per_request_auth": 1.0,
    "us_per_chunk": 25.0,
    "chunk_vs_nginx": 1.5,
    "rps": 1500.0,
    "added_p50_ms_c1": 1.0,
}
# The lean configuration: no access log, warnings only, one worker, no keys (unless --auth).
LEAN_ENV = {
    "NEMOTRON_ACCESS_LOG": "false",
    "NEMOTRON_LOG_LEVEL": "warning",
    "NEMOTRON_AUTH__ENABLED": "false",
    "NEMOTRON_WORKERS": "1",
}


@dataclass(frozen=True, slots=True)
class Options:
    """The run's shape, from the command line."""

    duration: float
    rounds: int
    warmup: float
    concurrency: tuple[int, ...]
    stream_concurrency: int
    chunks: tuple[int, int]
    chunk_delay: float
    max_requests: int
    pin: bool
    auth: bool = True
    redis_url: str | None = None
    nginx: bool = False
    lean: bool = False
    baseline: Path | None = None
    settings: tuple[tuple[str, str], ...] = ()  # NEMOTRON_* settings of this tree's gateway alone (`--setting`)
    tracing: bool = False

    @property
    def label(self) -> str:
        """The gateway's settings in words, for the report's title."""
        if not self.lean:
            label = "default settings: access log on, workers unset, API key and limits ON"
        else:
            label = f"lean: access log off, 1 worker, {'API key and limits ON' if self.auth else 'auth OFF'}"
        return label + "".join(f", {name}={value}" for name, value in self.settings)


def workloads(options: Options) -> list[Workload]:
    """Non-streamed at each concurrency, then streamed at two chunk counts (the slope is the cost per chunk)."""
    plain = [Workload(f"non-stream c={c}", c, False, 16) for c in options.concurrency]
    sc = options.stream_concurrency
    streams = [Workload(f"stream {n} chunks c={sc}", sc, True, n) for n in options.chunks]
    return plain + streams


async def measure(
    options: Options, urls: dict[str, str], meter: CpuMeter, headers: dict[str, str] | None = None
) -> list[PhaseRecord]:
    """Warm up (discarded), then every workload against every target per round, the order reversed every other
    round (ABBA: a drift in the machine's load falls on each target alike)."""
    records: list[PhaseRecord] = []
    plan = workloads(options)
    for workload in plan:
        for target, url in urls.items():
            await run_phase(
                -1,
                workload,
                "warmup",
                url,
                meter,
                duration=options.warmup,
                max_requests=100_000,
                headers=headers if target in _GATEWAYS else None,
            )
    for round_no in range(options.rounds):
        for workload in plan:
            order = list(urls) if round_no % 2 == 0 else list(reversed(urls))
            for target in order:
                record = await run_phase(
                    round_no,
                    workload,
                    target,
                    urls[target],
                    meter,
                    duration=options.duration,
                    max_requests=options.max_requests,
                    headers=headers if target in _GATEWAYS else None,
                )
                records.append(record)
                if options.tracing:
                    await asyncio.sleep(TRACING_SETTLE)
                proxy = target if target in record.cpu_s else GATEWAY
                sys.stderr.write(
                    f"round {round_no} {workload.name:<24} {target:<8} {record.rps:8.0f} req/s "
                    f"p50 {record.p50_ms:7.3f} ms  {proxy} cpu {record.cpu_per_request_ms(proxy):.3f} ms/req"
                    f"{f'  ERRORS {record.errors}: {record.first_error}' if record.errors else ''}\n"
                )
    return records


def _paired(records: list[PhaseRecord], workload: str, attr: str) -> float:
    """Median over rounds of gateway minus direct for one attribute."""
    direct = {r.round: getattr(r, attr) for r in pick(records, workload, DIRECT)}
    return median(getattr(r, attr) - direct[r.round] for r in pick(records, workload, GATEWAY) if r.round in direct)


def _chunk_cost_us(records: list[PhaseRecord], options: Options, plain_ms: float) -> tuple[float, float]:
    """µs of gateway CPU per relayed chunk: slope between the two chunk counts, and (stream - plain) / events."""
    few, many = (w for w in workloads(options) if w.stream)
    slope = chunk_cost_us(records, GATEWAY, (few, many))
    # Events per stream: the content chunks, the usage chunk and [DONE].
    per_stream = median(r.cpu_per_request_ms(GATEWAY) for r in pick(records, many.name, GATEWAY))
    return slope, (per_stream - plain_ms) * 1000 / (many.chunks + 2)


def _fmt(value: float, digits: int = 3) -> str:
    return "n/a" if math.isnan(value) else f"{value:.{digits}f}"


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def summarize(records: list[PhaseRecord], options: Options) -> tuple[list[list[str]], dict[str, Any]]:
    """Markdown rows and the JSON summary."""
    rows: list[list[str]] = []
    summary: dict[str, Any] = {}
    saturation = f"non-stream c={max(options.concurrency)}"
    for workload in workloads(options):
        name = workload.name
        d, g = pick(records, name, DIRECT), pick(records, name, GATEWAY)
        entry = {
            "direct_p50_ms": median(r.p50_ms for r in d),
            "gateway_p50_ms": median(r.p50_ms for r in g),
            "added_p50_ms": _paired(records, name, "p50_ms"),
            "direct_p99_ms": median(r.p99_ms for r in d),
            "gateway_p99_ms": median(r.p99_ms for r in g),
            "added_p99_ms": _paired(records, name, "p99_ms"),
            "direct_rps": median(r.rps for r in d),
            "gateway_rps": median(r.rps for r in g),
            "gateway_cpu_ms_per_request": median(r.cpu_per_request_ms(GATEWAY) for r in g),
            "gateway_cpu_sys_share": median(r.sys_share(GATEWAY) for r in g),
            "engine_cpu_ms_per_request": median(r.cpu_per_request_ms(ENGINE) for r in d),
            "gateway_core_busy": median(r.busy(GATEWAY) for r in g),
            "core1_busy_through_gateway": median(r.busy(ENGINE, "loadgen") for r in g),
            "gateway_run_queue_wait": median(r.waiting(GATEWAY) for r in g),
            "errors": sum(r.errors for r in d + g),
        }
        if options.nginx:
            n = pick(records, name, NGINX)
            entry["nginx_p50_ms"] = median(r.p50_ms for r in n)
            entry["nginx_p99_ms"] = median(r.p99_ms for r in n)
            entry["nginx_rps"] = median(r.rps for r in n)
            entry["nginx_cpu_ms_per_request"] = median(r.cpu_per_request_ms(NGINX) for r in n)
            entry["errors"] += sum(r.errors for r in n)
        if workload.stream:
            entry["direct_first_byte_p50_ms"] = median(r.first_byte_p50_ms for r in d)
            entry["gateway_first_byte_p50_ms"] = median(r.first_byte_p50_ms for r in g)
            entry["direct_reads_per_stream"] = median(r.reads_per_request for r in d)
            entry["gateway_reads_per_stream"] = median(r.reads_per_request for r in g)
        summary[name] = entry
        rows.append(
            [
                name,
                f"{_fmt(entry['direct_p50_ms'])} / {_fmt(entry['direct_p99_ms'])}",
                f"{_fmt(entry['gateway_p50_ms'])} / {_fmt(entry['gateway_p99_ms'])}",
                f"{_fmt(entry['added_p50_ms'])} / {_fmt(entry['added_p99_ms'])}",
                f"{entry['direct_rps']:.0f} / {entry['gateway_rps']:.0f}",
                f"{_fmt(entry['gateway_cpu_ms_per_request'])} ({entry['gateway_cpu_sys_share'] * 100:.0f}%)",
                f"{entry['gateway_core_busy'] * 100:.0f}% / {entry['core1_busy_through_gateway'] * 100:.0f}%",
                f"{entry['gateway_run_queue_wait'] * 100:.0f}%",
                str(entry["errors"]),
            ]
        )
    plain_ms = summary[saturation]["gateway_cpu_ms_per_request"]
    slope, minus_plain = _chunk_cost_us(records, options, plain_ms)
    c1 = f"non-stream c={min(options.concurrency)}"
    per_request = TARGETS["ms_per_request_auth" if options.auth else "ms_per_request"]
    summary["targets"] = {
        "gateway_cpu_ms_per_request": [plain_ms, per_request, plain_ms <= per_request],
        "gateway_cpu_us_per_chunk_slope": [slope, TARGETS["us_per_chunk"], slope <= TARGETS["us_per_chunk"]],
        "gateway_cpu_us_per_chunk_minus_plain": [minus_plain, TARGETS["us_per_chunk"], None],
        "gateway_rps_saturation": [
            summary[saturation]["gateway_rps"],
            TARGETS["rps"],
            summary[saturation]["gateway_rps"] >= TARGETS["rps"],
        ],
        "added_p50_ms_c1": [
            summary[c1]["added_p50_ms"],
            TARGETS["added_p50_ms_c1"],
            summary[c1]["added_p50_ms"] <= TARGETS["added_p50_ms_c1"],
        ],
    }
    if options.nginx:
        few, many = (w for w in workloads(options) if w.stream)
        nginx_slope = chunk_cost_us(records, NGINX, (few, many))
        ratio = chunk_cost_ratio(records, GATEWAY, NGINX, (few, many))
        limit = TARGETS["chunk_vs_nginx"]
        summary["targets"]["nginx_cpu_us_per_chunk_slope"] = [nginx_slope, None, None]
        summary["targets"]["gateway_vs_nginx_per_chunk"] = [ratio, limit, ratio <= limit]
        # The ratio of the two medians, as reported before the per-round ratio: beside it, for comparison.
        of_medians = slope / nginx_slope if nginx_slope > 0 else float("nan")
        summary["targets"]["gateway_vs_nginx_per_chunk_of_medians"] = [of_medians, None, None]
    return rows, summary


def render(rows: list[list[str]], summary: dict[str, Any], options: Options) -> str:
    """The Markdown report."""
    header = [
        "workload",
        "direct p50/p99 ms",
        "gateway p50/p99 ms",
        "added p50/p99 ms",
        "req/s direct/gw",
        "gw CPU ms/req (kernel share)",
        "core0/core1 busy",
        "gw waited for CPU",
        "errors",
    ]
    lines = [
        f"Medians of {options.rounds} interleaved rounds, {options.duration:g} s per phase; gateway pinned to core 0, "
        f"engine + load generator on core 1{'' if options.pin else ' (NOT pinned)'}; "
        f"stream chunk delay {options.chunk_delay * 1000:g} ms. 'gw waited for CPU': share of wall time the "
        "gateway's event loop was runnable but not running (other load on core 0; 0% on a quiet machine).",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(row) + " |" for row in rows),
        "",
        "| target | measured | limit | verdict |",
        "|---|---|---|---|",
    ]
    labels = {
        "gateway_cpu_ms_per_request": "gateway CPU ms / non-stream request (saturation)",
        "gateway_cpu_us_per_chunk_slope": "gateway CPU µs / relayed chunk (slope between chunk counts)",
        "gateway_cpu_us_per_chunk_minus_plain": "gateway CPU µs / chunk ((stream - non-stream) / events)",
        "gateway_rps_saturation": "gateway non-stream req/s at saturation",
        "added_p50_ms_c1": "added p50 ms at concurrency 1",
        "nginx_cpu_us_per_chunk_slope": "nginx CPU µs / relayed chunk (the reference, same run)",
        "gateway_vs_nginx_per_chunk": "gateway ÷ nginx CPU per relayed chunk (median of the rounds' ratios)",
        "gateway_vs_nginx_per_chunk_of_medians": "gateway ÷ nginx CPU per relayed chunk (ratio of the medians)",
    }
    for key, (value, limit, ok) in summary["targets"].items():
        comparison = "≥" if key == "gateway_rps_saturation" else "≤"
        bound = "-" if limit is None else f"{comparison} {limit:g}"
        lines.append(f"| {labels[key]} | {_fmt(value)} | {bound} | {'-' if ok is None else _verdict(ok)} |")
    streams = [w for w in workloads(options) if w.stream]
    lines += ["", "| stream | first byte p50 direct/gw ms | client reads per stream direct/gw |", "|---|---|---|"]
    for workload in streams:
        e = summary[workload.name]
        lines.append(
            f"| {workload.name} | {_fmt(e['direct_first_byte_p50_ms'])} / {_fmt(e['gateway_first_byte_p50_ms'])} | "
            f"{_fmt(e['direct_reads_per_stream'], 1)} / {_fmt(e['gateway_reads_per_stream'], 1)} |"
        )
    if options.nginx:
        lines += [
            "",
            "| workload (nginx, the reference) | nginx p50/p99 ms | nginx req/s | nginx CPU ms/req | gw ÷ nginx CPU |",
            "|---|---|---|---|---|",
        ]
        for workload in workloads(options):
            e = summary[workload.name]
            ratio = e["gateway_cpu_ms_per_request"] / e["nginx_cpu_ms_per_request"]
            lines.append(
                f"| {workload.name} | {_fmt(e['nginx_p50_ms'])} / {_fmt(e['nginx_p99_ms'])} | {e['nginx_rps']:.0f} | "
                f"{_fmt(e['nginx_cpu_ms_per_request'])} | {_fmt(ratio, 1)} |"
            )
    return "\n".join(lines) + "\n"


@dataclass(frozen=True, slots=True)
class Targets:
    """The started processes: the chat-completions URL of each target, the metered pids, the gateway's headers."""

    urls: dict[str, str]
    pids: dict[str, int]
    headers: dict[str, str] | None


def run(options: Options) -> tuple[list[PhaseRecord], dict[str, dict[str, float]]]:
    """Start the targets, measure, stop them; the records, and with `--tracing` each traced gateway's span counts."""
    with ExitStack() as stack:
        targets = start_targets(options, stack)
        records = asyncio.run(measure(options, targets.urls, CpuMeter(targets.pids), targets.headers))
        return records, {name: span_counts(targets.urls[name]) for name in TRACED if name in targets.urls}


def span_counts(chat_url: str) -> dict[str, float]:
    """A gateway's exported and dropped spans, from its /metrics (`chat_url`: its chat-completions URL)."""
    base = chat_url.removesuffix("/v1/chat/completions")
    found = {"exported": 0.0, "dropped": 0.0}
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        if line.startswith("nemotron_gateway_trace_spans_exported_total "):
            found["exported"] += float(line.rsplit(" ", 1)[1])
        elif line.startswith("nemotron_gateway_trace_spans_dropped_total{"):
            found["dropped"] += float(line.rsplit(" ", 1)[1])
    return found


def start_targets(options: Options, stack: ExitStack) -> Targets:
    """Start Redis (for keys, unless one is given), the stub engine, the gateway and nginx, stopped by `stack`."""
    pin = options.pin
    engine_port = free_port()
    engine_url = f"http://127.0.0.1:{engine_port}"
    gateway_cmd = Path(sys.executable).with_name("nemotron-gateway")
    redis_url = options.redis_url
    if options.auth and redis_url is None:
        redis_port = free_port()
        stack.enter_context(redis_process(redis_port, core=1 if pin else None))
        wait_redis(redis_port)
        redis_url = f"redis://127.0.0.1:{redis_port}/0"
    headers, key_name = None, f"bench-{os.getpid()}"
    if redis_url is not None and options.auth:
        headers = {"Authorization": f"Bearer {_create_key(gateway_cmd, redis_url, key_name)}"}
        stack.callback(_keys_cli, gateway_cmd, redis_url, "revoke", key_name)
    engine_argv = ["--port", str(engine_port), "--chunk-delay", str(options.chunk_delay)]
    engine = stack.enter_context(
        BenchProcess(ENGINE, python_argv("loadtest.stub_engine", *engine_argv), core=1 if pin else None)
    )
    gateway_port = free_port()
    gateway_url = f"http://127.0.0.1:{gateway_port}"
    gateway_argv = ["serve", "--host", "127.0.0.1", "--port", str(gateway_port), "--engine-url", engine_url]
    gateway = stack.enter_context(
        BenchProcess(
            GATEWAY,
            [str(gateway_cmd), *gateway_argv],
            core=0 if pin else None,
            env=_gateway_env(options, redis_url) | dict(options.settings),
            inherit=False,
        )
    )
    if pin:
        pin_self(1)
    engine.wait_http(engine_url + "/health")
    gateway.wait_http(gateway_url + "/ready")
    pids = {GATEWAY: gateway.pid, ENGINE: engine.pid}
    urls = {DIRECT: engine_url + "/v1/chat/completions", GATEWAY: gateway_url + "/v1/chat/completions"}
    if options.baseline is not None:
        base_port = free_port()
        env = _gateway_env(options, redis_url) | {"PYTHONPATH": str(options.baseline.resolve())}
        base_argv = [*gateway_argv[:4], str(base_port), *gateway_argv[5:]]
        base = stack.enter_context(
            # -P: the working directory (this tree) must not come before PYTHONPATH on the import path.
            BenchProcess(
                BASELINE,
                [sys.executable, "-P", "-m", "gateway", *base_argv],
                core=0 if pin else None,
                env=env,
                inherit=False,
            )
        )
        base.wait_http(f"http://127.0.0.1:{base_port}/ready")
        pids[BASELINE] = base.pid
        urls[BASELINE] = f"http://127.0.0.1:{base_port}/v1/chat/completions"
    if options.tracing:
        sink_port = free_port()
        sink = stack.enter_context(
            BenchProcess(SINK, python_argv("loadtest.otlp_sink", "--port", str(sink_port)), core=1 if pin else None)
        )
        sink.wait_http(f"http://127.0.0.1:{sink_port}/stats")
        for name, ratio in TRACED.items():
            port = free_port()
            tracing = TRACING_ENV | {
                "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{sink_port}",
                "OTEL_TRACES_SAMPLER_ARG": ratio,
            }
            traced = stack.enter_context(
                BenchProcess(
                    name,
                    [str(gateway_cmd), *gateway_argv[:4], str(port), *gateway_argv[5:]],
                    core=0 if pin else None,
                    env=_gateway_env(options, redis_url) | dict(options.settings) | tracing,
                    inherit=False,
                )
            )
            traced.wait_http(f"http://127.0.0.1:{port}/ready")
            pids[name] = traced.pid
            urls[name] = f"http://127.0.0.1:{port}/v1/chat/completions"
    binary = nginx_binary()
    if options.nginx and binary is not None:
        nginx_port = free_port()
        root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="loadtest-nginx-")))
        nginx = stack.enter_context(nginx_process(binary, root, nginx_port, engine_port, 0 if pin else None))
        # Any path reaches the engine through nginx; the stub answers GET /health.
        nginx.wait_http(f"http://127.0.0.1:{nginx_port}/health")
        pids[NGINX] = nginx.pid
        urls[NGINX] = f"http://127.0.0.1:{nginx_port}/v1/chat/completions"
    return Targets(urls, pids, headers)


def _gateway_env(options: Options, redis_url: str | None) -> dict[str, str]:
    """The gateway's whole environment: the caller's less its NEMOTRON_* and OTEL_* settings (the run names its own),
    plus the lean settings (or none: the defaults) and, with keys, the Redis to keep them in."""
    env = {name: value for name, value in os.environ.items() if not name.startswith(("NEMOTRON_", "OTEL_"))}
    if options.lean:
        env |= LEAN_ENV
    if options.auth and redis_url is not None:
        env |= {"NEMOTRON_AUTH__ENABLED": "true", "NEMOTRON_REDIS_URL": redis_url}
    return env


def _keys_cli(gateway_cmd: Path, redis_url: str, *args: str) -> str:
    done = subprocess.run(
        [str(gateway_cmd), "keys", *args, "--redis-url", redis_url], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"nemotron-gateway keys {args[0]} failed: {done.stderr.strip()}")
    return done.stdout


def _create_key(gateway_cmd: Path, redis_url: str, name: str) -> str:
    """A key whose limits never refuse, so every request still runs the full admission script."""
    limits = ["--rpm", "100000000", "--tpm", "1000000000", "--max-concurrency", "100000"]
    return _keys_cli(gateway_cmd, redis_url, "create", "--name", name, *limits).strip().splitlines()[-1]


def parse_options(argv: Sequence[str] | None) -> tuple[Options, Path | None]:
    """Options and the optional JSON output path."""
    parser = argparse.ArgumentParser(prog="python -m loadtest.overhead", description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=2.0, help="seconds per measured phase")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds (medians are reported)")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds of discarded load per phase kind")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32], help="non-stream concurrency levels")
    parser.add_argument("--stream-concurrency", type=int, default=64)
    parser.add_argument("--chunks", type=int, nargs=2, default=[16, 64], metavar=("FEW", "MANY"))
    parser.add_argument(
        "--chunk-delay",
        type=float,
        default=0.01,
        help="engine's seconds between two chunks of one stream (long enough that a relay reads them one by one)",
    )
    parser.add_argument("--max-requests", type=int, default=200_000, help="bound on requests per phase")
    parser.add_argument("--no-pin", action="store_true", help="do not pin processes to cores")
    parser.add_argument("--json", type=Path, help="also write the records and summary here")
    parser.add_argument(
        "--lean", action="store_true", help="the relay alone: access log off, one worker, no keys (unless --auth)"
    )
    parser.add_argument("--auth", action="store_true", help="with --lean: an API key and the Redis limiter on")
    parser.add_argument("--redis-url", help="a running Redis for the keys (default: a private redis-server)")
    parser.add_argument("--no-nginx", action="store_true", help="leave out nginx, the reference proxy")
    parser.add_argument(
        "--baseline",
        type=Path,
        help="also measure, in the same rounds, the gateway of another source tree (a directory holding its "
        "`gateway` package, e.g. from `git archive REV gateway | tar -x -C DIR`); reported after this tree's",
    )
    parser.add_argument(
        "--tracing",
        action="store_true",
        help="also measure, in the same rounds, this tree's gateway with tracing on, sampled at 100 %% and at 1 %% "
        "(exporting to an OTLP sink); reported after the gateway with tracing off",
    )
    parser.add_argument(
        "--setting",
        action="append",
        default=[],
        metavar="NEMOTRON_NAME=VALUE",
        help="a setting of this tree's gateway, not the baseline's (repeatable): measure one setting against the "
        "tree without it",
    )
    args = parser.parse_args(argv)
    few, many = sorted(args.chunks)
    if few == many:
        parser.error("--chunks needs two different counts")
    settings: list[tuple[str, str]] = []
    for setting in args.setting:
        name, equals, value = setting.partition("=")
        if not equals or not name.startswith("NEMOTRON_"):
            parser.error(f"--setting takes NEMOTRON_NAME=VALUE, not {setting!r}")
        settings.append((name, value))
    options = Options(
        duration=args.duration,
        rounds=max(1, args.rounds),
        warmup=args.warmup,
        concurrency=tuple(sorted(set(args.concurrency))),
        stream_concurrency=args.stream_concurrency,
        chunks=(few, many),
        chunk_delay=args.chunk_delay,
        max_requests=args.max_requests,
        pin=can_pin() and not args.no_pin,
        auth=args.auth or not args.lean,
        redis_url=args.redis_url,
        nginx=not args.no_nginx and nginx_binary() is not None,
        lean=args.lean,
        baseline=args.baseline,
        settings=tuple(settings),
        tracing=args.tracing,
    )
    return options, args.json


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m loadtest.overhead`."""
    options, json_path = parse_options(argv)
    records, spans = run(options)
    rows, summary = summarize([r for r in records if r.target == GATEWAY or r.target not in _GATEWAYS], options)
    sys.stdout.write(f"Gateway overhead ({options.label}) at {revision()}\n\n" + render(rows, summary, options))
    report: dict[str, Any] = {"revision": revision(), "options": _options_json(options), "summary": summary}
    others = [r for r in records if r.target not in _GATEWAYS]
    if options.baseline is not None:
        # The baseline's records stand in for the gateway's: the same summary, in the same rounds.
        as_gateway = [_as_gateway(r, BASELINE) for r in records if r.target == BASELINE]
        base_rows, report["baseline_summary"] = summarize(others + as_gateway, options)
        sys.stdout.write(
            f"\nBaseline {options.baseline}, same rounds\n\n" + render(base_rows, report["baseline_summary"], options)
        )
    if options.tracing:
        report["tracing"] = {}
        for name, ratio in TRACED.items():
            as_traced = [_as_gateway(r, name) for r in records if r.target == name]
            traced_rows, traced = summarize(others + as_traced, options)
            report["tracing"][name] = {"ratio": float(ratio), "summary": traced, "spans": spans.get(name, {})}
            sys.stdout.write(
                f"\nTracing on, sampled at {float(ratio):.0%}, same rounds (spans {spans.get(name)})\n\n"
                + render(traced_rows, traced, options)
            )
    if json_path is not None:
        report["records"] = records_json(records)
        json_path.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    return 0


def _as_gateway(record: PhaseRecord, name: str) -> PhaseRecord:
    """A phase of another gateway (`name`: the baseline, a traced one) as the gateway's: its target and its CPU
    counters under the gateway's name."""
    return replace(
        record,
        target=GATEWAY,
        cpu_s={**record.cpu_s, GATEWAY: record.cpu_s[name]},
        sys_s={**record.sys_s, GATEWAY: record.sys_s[name]},
        wait_s={**record.wait_s, GATEWAY: record.wait_s[name]},
    )


def _options_json(options: Options) -> dict[str, Any]:
    values = {name: getattr(options, name) for name in Options.__slots__}
    return {name: str(value) if isinstance(value, Path) else value for name, value in values.items()}


if __name__ == "__main__":
    raise SystemExit(main())
