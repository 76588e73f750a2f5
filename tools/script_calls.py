"""`python -m tools.script_calls`: the CPU one Lua script call of the gateway's Redis client costs (a development tool:
it runs the gateway's own `DirectScript` in-process, where the load tool drives the gateway from outside).

The hot path of keys and limits is two script calls a request (admission, release), each through `DirectScript`.
This measures that call alone: `--calls` calls of a small script (an INCR and an echo, the size of the limiter's
replies) one at a time and from 32 callers at once, in a process pinned to core 0, against a private redis-server on
core 1 (or `--redis-url`, a db the run may write one key to). `--baseline DIR` measures the `gateway` package of
another source tree (`git archive REV gateway | tar -x -C DIR`) in the same rounds, alternating, each in a process
of its own; the medians over `--rounds` are printed as a table (and `--json`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from loadtest.processes import REPO_ROOT, can_pin, free_port, redis_process, wait_redis

_SCRIPT = "redis.call('INCR', KEYS[1]); return {redis.call('GET', KEYS[1]), ARGV[1]}"
_KEY = "nemotron:bench:script-calls"
CONCURRENCY = (1, 32)


async def _measure(redis_url: str, calls: int) -> dict[str, dict[str, float]]:
    """Per concurrency: calls/s and CPU µs a call of `DirectScript` (whichever `gateway` this process imports)."""
    from pydantic import SecretStr

    from gateway.redis import DirectScript, close_redis, connect_redis
    from gateway.settings import Settings

    client = connect_redis(Settings(redis_url=SecretStr(redis_url)))
    script = DirectScript(client, _SCRIPT)
    found: dict[str, dict[str, float]] = {}
    try:
        await script(keys=[_KEY], args=["warm"])  # connected, the script loaded
        for concurrency in CONCURRENCY:
            each = max(1, calls // concurrency)

            async def caller(count: int = each) -> None:
                for _ in range(count):
                    await script(keys=[_KEY], args=["x"])

            before, started = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            await asyncio.gather(*(caller() for _ in range(concurrency)))
            wall, after = time.perf_counter() - started, resource.getrusage(resource.RUSAGE_SELF)
            cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
            done = each * concurrency
            found[f"c={concurrency}"] = {"calls_per_s": done / wall, "cpu_us_per_call": cpu / done * 1e6}
        await client.delete(_KEY)
    finally:
        await close_redis(client)
    return found


def _run_tree(tree: Path, redis_url: str, calls: int, pin: bool) -> dict[str, dict[str, float]]:
    """One measurement in a process of its own that imports `tree`'s `gateway` package."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(REPO_ROOT)])}
    argv = [sys.executable, "-P", "-m", "tools.script_calls", "--measure", "--redis-url", redis_url]
    argv += ["--calls", str(calls)]
    if pin:
        argv = ["taskset", "-c", "0", *argv]
    done = subprocess.run(argv, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the measurement of {tree} failed:\n{done.stderr[-2000:]}")
    found: dict[str, dict[str, float]] = json.loads(done.stdout.strip().splitlines()[-1])
    return found


def compare(trees: dict[str, Path], redis_url: str, calls: int, rounds: int, pin: bool) -> dict[str, Any]:
    """Medians over `rounds` of each tree's figures, the trees' order reversed every other round."""
    runs: dict[str, list[dict[str, dict[str, float]]]] = {name: [] for name in trees}
    for round_no in range(rounds):
        order = list(trees) if round_no % 2 == 0 else list(reversed(trees))
        for name in order:
            runs[name].append(_run_tree(trees[name], redis_url, calls, pin))
    return {
        name: {
            level: {figure: statistics.median(run[level][figure] for run in found) for figure in found[0][level]}
            for level in found[0]
        }
        for name, found in runs.items()
    }


def _table(summary: dict[str, Any], calls: int, rounds: int) -> str:
    lines = [
        f"DirectScript calls ({calls} a point, medians of {rounds} rounds; caller on core 0, Redis on core 1)",
        "",
        "| tree | concurrency | calls/s | CPU µs / call |",
        "|---|---|---|---|",
    ]
    for name, levels in summary.items():
        for level, figures in levels.items():
            lines.append(f"| {name} | {level} | {figures['calls_per_s']:.0f} | {figures['cpu_us_per_call']:.1f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: `python -m tools.script_calls [--baseline DIR] [--calls N] [--rounds R]`."""
    parser = argparse.ArgumentParser(prog="python -m tools.script_calls", description=__doc__)
    parser.add_argument("--calls", type=int, default=6000, help="script calls per concurrency and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", type=Path, help="a directory holding another tree's `gateway` package")
    parser.add_argument("--redis-url", help="a Redis to use (default: a private redis-server)")
    parser.add_argument("--json", type=Path, help="also write the medians here")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # one tree's run, JSON out
    args = parser.parse_args(argv)
    if args.measure:
        sys.stdout.write(json.dumps(asyncio.run(_measure(args.redis_url, args.calls))) + "\n")
        return 0
    pin = can_pin()
    with ExitStack() as stack:
        redis_url = args.redis_url
        if redis_url is None:
            port = free_port()
            stack.enter_context(redis_process(port, core=1 if pin else None))
            wait_redis(port)
            redis_url = f"redis://127.0.0.1:{port}/0"
        trees = {"this tree": REPO_ROOT}
        if args.baseline is not None:
            if not (args.baseline / "gateway" / "__init__.py").is_file():
                # Else this tree's package would be imported in its place (it is on the path for `loadtest`).
                raise SystemExit(f"{args.baseline} holds no gateway package: git archive REV gateway | tar -x -C DIR")
            trees["baseline"] = args.baseline.resolve()
        summary = compare(trees, redis_url, args.calls, args.rounds, pin)
    sys.stdout.write(_table(summary, args.calls, args.rounds) + "\n")
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
