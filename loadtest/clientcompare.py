"""Which HTTP client the relay should use: the same minimal pass-through on httpx and on aiohttp, CPU-metered.

Both relays (loadtest/passthrough.py) and, for reference, the gateway itself run under uvicorn (uvloop,
httptools) pinned to core 0; the stub engine and this load generator share core 1. Targets are loaded one
at a time, rotated within each round. Imports nothing from `gateway`.

    python -m loadtest.clientcompare [--duration S] [--rounds K] [--targets httpx aiohttp gateway] [--json OUT]

`--gateway-variant NAME=DIR` adds a gateway started with DIR first on PYTHONPATH (a patched copy of the
`gateway` package), so a candidate change is measured interleaved with the current code.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from loadtest.phases import CpuMeter, PhaseRecord, Workload, chunk_cost_us, median, pick, records_json, run_phase
from loadtest.processes import BenchProcess, can_pin, free_port, pin_self, python_argv, revision

ENGINE = "engine"
RELAYS = ("httpx", "aiohttp")
GATEWAY = "gateway"
GATEWAY_ENV = {"NEMOTRON_ACCESS_LOG": "false", "NEMOTRON_LOG_LEVEL": "warning", "NEMOTRON_AUTH__ENABLED": "false"}


def plan(concurrency: int, stream_concurrency: int, chunks: tuple[int, int]) -> list[Workload]:
    """Non-streamed at concurrency 1 and under load, then streamed at two chunk counts."""
    return [
        Workload("non-stream c=1", 1, False, 16),
        Workload(f"non-stream c={concurrency}", concurrency, False, 16),
        *(Workload(f"stream {n} chunks c={stream_concurrency}", stream_concurrency, True, n) for n in chunks),
    ]


async def measure(
    workloads: list[Workload], urls: dict[str, str], meter: CpuMeter, *, duration: float, rounds: int, warmup: float
) -> list[PhaseRecord]:
    """Warm up (discarded), then each workload against every target per round, the order rotated each round."""
    names = list(urls)
    for workload in workloads:
        for url in urls.values():
            await run_phase(-1, workload, "warmup", url, meter, duration=warmup, max_requests=100_000)
    records: list[PhaseRecord] = []
    for round_no in range(rounds):
        order = names[round_no % len(names) :] + names[: round_no % len(names)]
        for workload in workloads:
            for target in order:
                record = await run_phase(
                    round_no, workload, target, urls[target], meter, duration=duration, max_requests=200_000
                )
                records.append(record)
                sys.stderr.write(
                    f"round {round_no} {workload.name:<24} {target:<8} {record.rps:8.0f} req/s "
                    f"cpu {record.cpu_per_request_ms(target):.3f} ms/req"
                    f"{f'  ERRORS {record.errors}: {record.first_error}' if record.errors else ''}\n"
                )
    return records


def summarize(records: list[PhaseRecord], workloads: list[Workload], targets: Sequence[str]) -> dict[str, Any]:
    """Per target: CPU per request for each workload, req/s and p50 for the non-streamed ones, µs per chunk."""
    streams = (workloads[2], workloads[3])
    summary: dict[str, Any] = {}
    for target in targets:
        entry: dict[str, Any] = {}
        for workload in workloads:
            mine = pick(records, workload.name, target)
            entry[workload.name] = {
                "cpu_ms_per_request": median(r.cpu_per_request_ms(target) for r in mine),
                "cpu_sys_share": median(r.sys_share(target) for r in mine),
                "rps": median(r.rps for r in mine),
                "p50_ms": median(r.p50_ms for r in mine),
                "p99_ms": median(r.p99_ms for r in mine),
                "core0_busy": median(r.busy(target) for r in mine),
                "run_queue_wait": median(r.waiting(target) for r in mine),
                "errors": sum(r.errors for r in mine),
                "reads_per_request": median(r.reads_per_request for r in mine),
            }
        entry["cpu_us_per_chunk"] = chunk_cost_us(records, target, streams)
        summary[target] = entry
    return summary


def render(summary: dict[str, Any], workloads: list[Workload], rounds: int, duration: float) -> str:
    """The Markdown table."""
    c1, load, few, many = (w.name for w in workloads)
    header = [
        "relay",
        f"CPU ms/req ({c1})",
        f"p50 ms ({c1})",
        f"CPU ms/req ({load}, kernel share)",
        f"req/s ({load})",
        "CPU ms/stream (few/many chunks)",
        "CPU µs/chunk",
        "client reads/stream (many)",
        "waited for CPU",
        "errors",
    ]
    lines = [
        f"Medians of {rounds} rounds, {duration:g} s per phase; each relay pinned to core 0 under uvicorn "
        f"(uvloop, httptools); engine + load generator on core 1. Streams: {few}; {many}.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for target, entry in summary.items():
        errors = sum(entry[w.name]["errors"] for w in workloads)
        lines.append(
            f"| {target} | {entry[c1]['cpu_ms_per_request']:.3f} | {entry[c1]['p50_ms']:.3f} | "
            f"{entry[load]['cpu_ms_per_request']:.3f} ({entry[load]['cpu_sys_share'] * 100:.0f}%) | "
            f"{entry[load]['rps']:.0f} | "
            f"{entry[few]['cpu_ms_per_request']:.3f} / {entry[many]['cpu_ms_per_request']:.3f} | "
            f"{entry['cpu_us_per_chunk']:.1f} | {entry[many]['reads_per_request']:.1f} | "
            f"{entry[load]['run_queue_wait'] * 100:.0f}% | {errors} |"
        )
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> tuple[list[PhaseRecord], list[Workload], list[str]]:
    """Start the engine and the relays, measure, stop them all."""
    pin = can_pin() and not args.no_pin
    engine_port = free_port()
    engine_url = f"http://127.0.0.1:{engine_port}"
    engine_argv = python_argv(
        "loadtest.stub_engine", "--port", str(engine_port), "--chunk-delay", str(args.chunk_delay)
    )
    servers = {ENGINE: BenchProcess(ENGINE, engine_argv, core=1 if pin else None)}
    urls: dict[str, str] = {}
    for client in (c for c in RELAYS if c in args.targets):
        port = free_port()
        argv = python_argv("loadtest.passthrough", "--client", client, "--port", str(port), "--engine-url", engine_url)
        servers[client] = BenchProcess(client, argv, core=0 if pin else None)
        urls[client] = f"http://127.0.0.1:{port}"
    gateways = {GATEWAY: GATEWAY_ENV} if GATEWAY in args.targets else {}
    for variant in args.gateway_variant:
        name, _, path = variant.partition("=")
        gateways[name] = GATEWAY_ENV | {"PYTHONPATH": str(Path(path).resolve())}
    for name, env in gateways.items():
        port = free_port()
        gateway_cmd = str(Path(sys.executable).with_name("nemotron-gateway"))
        argv = [gateway_cmd, "serve", "--host", "127.0.0.1", "--port", str(port), "--engine-url", engine_url]
        servers[name] = BenchProcess(name, argv, core=0 if pin else None, env=env)
        urls[name] = f"http://127.0.0.1:{port}"
    if pin:
        pin_self(1)
    workloads = plan(args.concurrency, args.stream_concurrency, (min(args.chunks), max(args.chunks)))
    try:
        for server in servers.values():
            server.start()
        servers[ENGINE].wait_http(engine_url + "/health")
        for name, url in urls.items():
            servers[name].wait_http(url + "/health")
        meter = CpuMeter({name: server.pid for name, server in servers.items()})
        completions = {name: url + "/v1/chat/completions" for name, url in urls.items()}
        records = asyncio.run(
            measure(workloads, completions, meter, duration=args.duration, rounds=args.rounds, warmup=args.warmup)
        )
    finally:
        for server in servers.values():
            server.stop()
    return records, workloads, list(urls)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m loadtest.clientcompare`."""
    parser = argparse.ArgumentParser(prog="python -m loadtest.clientcompare", description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=1.5, help="seconds per measured phase")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=float, default=0.5)
    parser.add_argument("--concurrency", type=int, default=32, help="non-stream concurrency under load")
    parser.add_argument("--stream-concurrency", type=int, default=64)
    parser.add_argument("--chunks", type=int, nargs=2, default=[16, 64], metavar=("FEW", "MANY"))
    parser.add_argument("--chunk-delay", type=float, default=0.01, help="engine's seconds between stream chunks")
    parser.add_argument(
        "--targets", nargs="+", choices=[*RELAYS, GATEWAY], default=[*RELAYS, GATEWAY], help="what to measure"
    )
    parser.add_argument(
        "--gateway-variant", action="append", default=[], metavar="NAME=DIR", help="also a gateway from DIR/gateway"
    )
    parser.add_argument("--no-pin", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.chunks[0] == args.chunks[1]:
        parser.error("--chunks needs two different counts")
    if any("=" not in v or not (Path(v.partition("=")[2]) / "gateway").is_dir() for v in args.gateway_variant):
        parser.error("--gateway-variant needs NAME=DIR where DIR/gateway is a package")
    records, workloads, targets = run(args)
    summary = summarize(records, workloads, targets)
    sys.stdout.write(
        f"HTTP client comparison at {revision()}\n\n" + render(summary, workloads, args.rounds, args.duration)
    )
    if args.json is not None:
        report: dict[str, Any] = {
            "revision": revision(),
            "options": vars(args) | {"json": str(args.json)},
            "summary": summary,
        }
        report["records"] = records_json(records)
        args.json.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
