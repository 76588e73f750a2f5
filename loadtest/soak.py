"""A bounded soak: mixed streamed and non-streamed traffic through the gateway, API key and limits on, for
minutes, with the RSS and open file descriptors of the gateway's processes sampled every few seconds. Exits 1
when either grows past its tolerance after the warm-up, when a request fails, or when requests stay in flight.

    python -m loadtest.soak [--duration 180] [--engine-url URL] [--redis-url URL]

Without --engine-url the stub engine serves (loadtest/stub_engine.py); with it, an engine already running
there (the real CPU vLLM). Without --redis-url a private redis-server is started. Writes
loadtest/results/soak.json and soak.md. Imports nothing from `gateway`: the gateway is a subprocess.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import re
import statistics
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from loadtest.overhead import _create_key, _keys_cli
from loadtest.processes import BenchProcess, free_port, process_tree, python_argv, redis_process, revision

RESULTS = Path("loadtest/results")
_IN_FLIGHT = re.compile(rb"^nemotron_gateway_requests_in_flight ([0-9.e+-]+)$", re.M)
# Each worker cycles through these: (route, streamed, abandoned after the first chunk).
_MIX = (
    ("/v1/chat/completions", True, False),
    ("/v1/chat/completions", False, False),
    ("/v1/completions", True, False),
    ("/v1/completions", False, False),
    ("/v1/chat/completions", True, True),
)


@dataclass(frozen=True)
class Options:
    duration: float
    warmup: float
    interval: float
    concurrency: int
    max_tokens: int
    chunk_delay: float
    engine_url: str | None
    redis_url: str | None
    max_rss_growth_mb: float
    max_fd_growth: int


@dataclass
class Sample:
    t: float
    rss_mb: float
    fds: int


@dataclass
class Tally:
    requests: int = 0
    streams: int = 0
    abandoned: int = 0
    statuses: Counter[str] = field(default_factory=Counter)


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def _sample(pid: int, started: float) -> Sample:
    """RSS and open fds summed over the gateway's processes."""
    rss, fds = 0.0, 0
    for member in process_tree(pid):
        with contextlib.suppress(OSError):  # a worker that just exited
            rss, fds = rss + _rss_mb(member), fds + len(os.listdir(f"/proc/{member}/fd"))
    return Sample(round(time.monotonic() - started, 2), round(rss, 2), fds)


async def _one(
    client: httpx.AsyncClient, route: str, body: dict[str, Any], stream: bool, abandon: bool, tally: Tally
) -> None:
    tally.requests += 1
    if not stream:
        response = await client.post(route, json=body)
        tally.statuses[str(response.status_code)] += 1
        return
    tally.streams += 1
    async with client.stream("POST", route, json={**body, "stream": True}) as response:
        tally.statuses[str(response.status_code)] += 1
        async for _ in response.aiter_raw():
            if abandon:
                tally.abandoned += 1
                break  # closing the response mid-stream: a client that hangs up


async def _worker(client: httpx.AsyncClient, model: str, options: Options, stop_at: float, tally: Tally) -> None:
    for route, stream, abandon in itertools.cycle(_MIX):
        if time.monotonic() >= stop_at:
            return
        if route.endswith("/chat/completions"):
            body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": "soak"}]}
        else:
            body = {"model": model, "prompt": "soak"}
        body["max_tokens"] = options.max_tokens
        try:
            await _one(client, route, body, stream, abandon, tally)
        except httpx.HTTPError as exc:
            tally.statuses[type(exc).__name__] += 1


async def _sampler(pid: int, options: Options, started: float, stop_at: float, samples: list[Sample]) -> None:
    while time.monotonic() < stop_at:
        samples.append(_sample(pid, started))
        await asyncio.sleep(options.interval)
    samples.append(_sample(pid, started))


async def _in_flight(client: httpx.AsyncClient) -> float:
    """The highest in-flight gauge of several scrapes, each on a new connection so that every worker answers."""
    highest = 0.0
    for _ in range(8):
        found = _IN_FLIGHT.search((await client.get("/metrics", headers={"Connection": "close"})).content)
        highest = max(highest, float(found.group(1)) if found else float("nan"))
    return highest


async def soak(options: Options, gateway_url: str, headers: dict[str, str], pid: int) -> dict[str, Any]:
    """Run the load and the sampler; the raw results."""
    limits = httpx.Limits(max_connections=options.concurrency + 4, max_keepalive_connections=options.concurrency + 4)
    timeout = httpx.Timeout(60.0, connect=5.0)
    async with httpx.AsyncClient(base_url=gateway_url, headers=headers, limits=limits, timeout=timeout) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        idle_in_flight = await _in_flight(client)
        tally, samples = Tally(), list[Sample]()
        started = time.monotonic()
        stop_at = started + options.duration
        await asyncio.gather(
            _sampler(pid, options, started, stop_at, samples),
            *(_worker(client, model, options, stop_at, tally) for _ in range(options.concurrency)),
        )
        # Requests of gone clients settle in the background: give them a moment before reading the gauge.
        for _ in range(50):
            left = await _in_flight(client)
            if left <= idle_in_flight:
                break
            await asyncio.sleep(0.2)
    return {
        "model": model,
        "tally": tally,
        "samples": samples,
        "in_flight_after": left,
        "idle_in_flight": idle_in_flight,
    }


def verdict(
    options: Options, samples: list[Sample], tally: Tally, in_flight_after: float, idle: float
) -> dict[str, Any]:
    """Growth from just after the warm-up to the end (medians of three samples each) against the tolerances."""
    after = [s for s in samples if s.t >= options.warmup] or samples
    head, tail = after[:3], after[-3:]
    rss_growth = statistics.median(s.rss_mb for s in tail) - statistics.median(s.rss_mb for s in head)
    fd_growth = statistics.median(s.fds for s in tail) - statistics.median(s.fds for s in head)
    errors = sum(count for status, count in tally.statuses.items() if status != "200")
    checks = {
        "rss": rss_growth <= options.max_rss_growth_mb,
        "fds": fd_growth <= options.max_fd_growth,
        "errors": errors == 0,
        "in_flight": in_flight_after <= idle,
    }
    return {
        "rss_growth_mb": round(rss_growth, 2),
        "fd_growth": fd_growth,
        "errors": errors,
        "in_flight_after": in_flight_after,
        "checks": checks,
        "passed": all(checks.values()),
    }


def markdown(report: dict[str, Any]) -> str:
    """The Markdown summary of a soak report."""
    o, v, t, s = report["options"], report["verdict"], report["tally"], report["samples"]
    engine = o["engine_url"] or "stub engine"
    mark = {True: "ok", False: "FAIL"}
    return "\n".join(
        [
            f"# Soak: {'passed' if v['passed'] else 'FAILED'}",
            "",
            f"{o['duration']:g} s of mixed traffic ({o['concurrency']} clients, keys and limits on) against the "
            f"gateway in front of {engine}; warm-up {o['warmup']:g} s; revision {report['revision']}.",
            "",
            "| measure | value | tolerance | |",
            "| --- | --- | --- | --- |",
            f"| requests (streams, abandoned mid-stream) | {t['requests']} ({t['streams']}, {t['abandoned']}) | | |",
            f"| non-200 answers or transport errors | {v['errors']} | 0 | {mark[v['checks']['errors']]} |",
            f"| gateway RSS, MB (first, last sample) | {s[0]['rss_mb']:.1f} → {s[-1]['rss_mb']:.1f} | | |",
            f"| RSS growth after warm-up, MB | {v['rss_growth_mb']:.1f} | ≤ {o['max_rss_growth_mb']:g} "
            f"| {mark[v['checks']['rss']]} |",
            f"| open fds (first, last sample) | {s[0]['fds']} → {s[-1]['fds']} | | |",
            f"| fd growth after warm-up | {v['fd_growth']:g} | ≤ {o['max_fd_growth']} | {mark[v['checks']['fds']]} |",
            f"| requests in flight after the load | {v['in_flight_after']:g} | ≤ {report['idle_in_flight']:g} "
            f"| {mark[v['checks']['in_flight']]} |",
            "",
        ]
    )


def run(options: Options) -> dict[str, Any]:
    """Start what is missing (Redis, stub engine), the gateway with a fresh key; soak; stop them."""
    processes: list[BenchProcess] = []
    try:
        redis_url = options.redis_url
        if redis_url is None:
            port = free_port()
            redis_url = f"redis://127.0.0.1:{port}/0"
            processes.append(redis_process(port, core=None))
            processes[-1].start()
        engine_url = options.engine_url
        if engine_url is None:
            port = free_port()
            engine_url = f"http://127.0.0.1:{port}"
            argv = python_argv("loadtest.stub_engine", "--port", str(port), "--chunk-delay", str(options.chunk_delay))
            processes.append(BenchProcess("engine", argv, core=None))
            processes[-1].start()
            processes[-1].wait_http(engine_url + "/health")
        gateway_cmd = Path(sys.executable).with_name("nemotron-gateway")
        key_name = f"soak-{os.getpid()}"
        secret = _wait_create_key(gateway_cmd, redis_url, key_name)
        gateway_port = free_port()
        gateway_url = f"http://127.0.0.1:{gateway_port}"
        env = {"NEMOTRON_REDIS_URL": redis_url, "NEMOTRON_ACCESS_LOG": "false", "NEMOTRON_LOG_LEVEL": "warning"}
        argv = [str(gateway_cmd), "serve", "--port", str(gateway_port), "--engine-url", engine_url]
        gateway = BenchProcess("gateway", argv, core=None, env=env)
        processes.append(gateway)
        gateway.start()
        gateway.wait_http(gateway_url + "/ready", within=60)
        try:
            raw = asyncio.run(soak(options, gateway_url, {"Authorization": f"Bearer {secret}"}, gateway.pid))
        finally:
            _keys_cli(gateway_cmd, redis_url, "revoke", key_name)
    finally:
        for process in reversed(processes):
            process.stop()
    tally: Tally = raw["tally"]
    samples: list[Sample] = raw["samples"]
    return {
        "revision": revision(),
        "options": asdict(options),
        "model": raw["model"],
        "idle_in_flight": raw["idle_in_flight"],
        "tally": {**asdict(tally), "statuses": dict(tally.statuses)},
        "samples": [asdict(sample) for sample in samples],
        "verdict": verdict(options, samples, tally, raw["in_flight_after"], raw["idle_in_flight"]),
    }


def _wait_create_key(gateway_cmd: Path, redis_url: str, name: str) -> str:
    """Create the soak's key once the (maybe just started) Redis answers."""
    deadline = time.monotonic() + 20
    while True:
        try:
            return _create_key(gateway_cmd, redis_url, name)
        except SystemExit:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.2)


def parse_options(argv: Sequence[str] | None) -> tuple[Options, Path, Path]:
    parser = argparse.ArgumentParser(prog="python -m loadtest.soak", description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=180.0, help="seconds of load (default 3 minutes)")
    parser.add_argument("--warmup", type=float, help="seconds before the growth baseline (default a sixth, ≤ 30)")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between two RSS/fd samples")
    parser.add_argument("--concurrency", type=int, default=8, help="clients sending back to back")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens asked for per request")
    parser.add_argument("--chunk-delay", type=float, default=0.005, help="stub engine's seconds between chunks")
    parser.add_argument("--engine-url", help="a running engine (e.g. the real CPU vLLM) instead of the stub")
    parser.add_argument("--redis-url", help="a running Redis instead of a private redis-server")
    parser.add_argument("--max-rss-growth-mb", type=float, default=8.0, help="tolerated RSS growth after warm-up")
    parser.add_argument("--max-fd-growth", type=int, default=16, help="tolerated growth of open fds after warm-up")
    parser.add_argument("--json", type=Path, default=RESULTS / "soak.json", help="where the JSON report goes")
    parser.add_argument("--markdown", type=Path, default=RESULTS / "soak.md", help="where the summary goes")
    args = parser.parse_args(argv)
    warmup = args.warmup if args.warmup is not None else round(min(30.0, args.duration / 6), 1)
    options = Options(
        duration=args.duration,
        warmup=warmup,
        interval=args.interval,
        concurrency=max(1, args.concurrency),
        max_tokens=args.max_tokens,
        chunk_delay=args.chunk_delay,
        engine_url=args.engine_url,
        redis_url=args.redis_url,
        max_rss_growth_mb=args.max_rss_growth_mb,
        max_fd_growth=args.max_fd_growth,
    )
    return options, args.json, args.markdown


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m loadtest.soak` (`make soak`): 0 when the gateway stayed flat."""
    options, json_path, markdown_path = parse_options(argv)
    report = run(options)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    markdown_path.parent.mkdir(parents=True, exist_ok=True)
    summary = markdown(report)
    markdown_path.write_text(summary)
    sys.stdout.write(summary)
    return 0 if report["verdict"]["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
