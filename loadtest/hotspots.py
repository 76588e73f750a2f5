"""Where the gateway's CPU goes under the overhead benchmark's load: py-spy attached to its worker(s).

Starts the same processes as `loadtest.overhead` (same settings: the defaults, or `--lean`), then for each
workload drives the gateway alone for `--seconds` while `py-spy record` samples it, and prints the top entries
by self time (the function running when sampled) and by inclusive time (on the stack). py-spy pauses the
process for each sample (a consistent stack; `--nonblocking` read stacks while they changed and credited
returned frames, such as a log call, with thousands of samples). Only samples where the
gateway was running count (py-spy leaves idle ones out), so the shares are of the gateway's CPU time.
Imports nothing from `gateway`.

    python -m loadtest.hotspots [--lean] [--seconds 20] [--top 15] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path

from loadtest.loadgen import run_load
from loadtest.overhead import GATEWAY, parse_options, start_targets, workloads
from loadtest.phases import Workload
from loadtest.stub_engine import MODEL

_SITE = "site-packages/"


@dataclass(frozen=True, slots=True)
class Hotspots:
    """Sample counts of one profile: per function, as the running frame and anywhere on the stack."""

    samples: int
    own: Counter[str]
    inclusive: Counter[str]


def frame_name(frame: str) -> str:
    """`function (path:line)` as `function (module path)`: lines merged, the venv's prefix dropped."""
    name, _, where = frame.partition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0]
    if _SITE in path:
        path = path.split(_SITE, 1)[1]
    elif "/gateway/" in path:
        path = "gateway/" + path.split("/gateway/", 1)[1]
    return f"{name} ({path})"


def parse_raw(text: str) -> Hotspots:
    """py-spy's `--format raw` output (one `frame;frame;... count` line per distinct stack, outermost first)."""
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    samples = 0
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        samples += n
        names = [frame_name(frame) for frame in stack.split(";")]
        own[names[-1]] += n
        for name in set(names):
            inclusive[name] += n
    return Hotspots(samples, own, inclusive)


def render(title: str, spots: Hotspots, top: int) -> str:
    """A Markdown table of the top entries by self time, with each one's inclusive share."""
    lines = [
        f"{title}: {spots.samples} samples of the gateway running",
        "",
        "| self | on stack | function (module) |",
        "|---|---|---|",
    ]
    for name, n in spots.own.most_common(top):
        lines.append(f"| {n / spots.samples:.1%} | {spots.inclusive[name] / spots.samples:.1%} | {name} |")
    return "\n".join(lines) + "\n"


def py_spy() -> str:
    """The py-spy executable (the `loadtest` extra installs it into the venv)."""
    found = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if found is None:
        raise SystemExit("py-spy is not installed: pip install py-spy (it is in the project's `loadtest` extra)")
    return found


async def _drive(url: str, workload: Workload, seconds: float, headers: dict[str, str] | None) -> int:
    result = await run_load(
        url,
        workload.body(MODEL),
        concurrency=workload.concurrency,
        duration=seconds,
        max_requests=10_000_000,
        stream=workload.stream,
        headers=headers,
    )
    return result.requests


def profile(argv: Sequence[str] | None = None) -> int:
    """Entry point: profile each workload of the overhead benchmark's (the largest non-stream concurrency and
    the longer stream), print the tables, keep the raw profiles in `--out`."""
    parser = argparse.ArgumentParser(prog="python -m loadtest.hotspots", description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="seconds of load per workload")
    parser.add_argument("--top", type=int, default=15, help="entries per table")
    parser.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    parser.add_argument("--out", type=Path, help="keep the raw profiles here (default: a temporary directory)")
    ours, rest = parser.parse_known_args(argv)
    options, _ = parse_options([*rest, "--no-nginx"])
    options = replace(options, nginx=False)
    plan = workloads(options)
    chosen = [w for w in plan if not w.stream][-1:] + [w for w in plan if w.stream][-1:]
    spy = py_spy()
    with ExitStack() as stack:
        out = ours.out or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="loadtest-hotspots-")))
        out.mkdir(parents=True, exist_ok=True)
        targets = start_targets(options, stack)
        url, pid = targets.urls[GATEWAY], targets.pids[GATEWAY]
        sys.stdout.write(f"Gateway hotspots ({options.label}), py-spy at {ours.rate} Hz\n\n")
        for workload in chosen:
            asyncio.run(_drive(url, workload, 2.0, targets.headers))  # warm: connections, caches
            raw = out / f"{workload.name.replace(' ', '-').replace('=', '')}.raw"
            argv = [spy, "record", "--gil", "--subprocesses", "-r", str(ours.rate), "-f", "raw"]
            argv += ["-d", str(int(ours.seconds) + 1), "-o", str(raw), "-p", str(pid)]
            recorder = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            try:
                requests = asyncio.run(_drive(url, workload, ours.seconds, targets.headers))
            finally:
                _, errors = recorder.communicate(timeout=ours.seconds + 30)
            if recorder.returncode != 0 or not raw.exists():
                raise SystemExit(f"py-spy failed ({recorder.returncode}): {errors.decode(errors='replace')[-500:]}")
            spots = parse_raw(raw.read_text())
            title = f"{workload.name}, {requests} requests in {ours.seconds:g} s"
            sys.stdout.write(render(title, spots, ours.top) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(profile())
