"""Where a relayed stream's CPU goes, the gateway against nginx: each relays the same streams while `perf record`
samples it, then while `strace -c` counts its system calls.

Starts the same processes as `loadtest.overhead` (same settings: the defaults, or `--lean`) and drives the
benchmark's longer stream workload through the gateway and through nginx, `--requests` streams each. The CPU is
split by where it ran (the kernel: socket reads and writes; the Python interpreter; uvloop; httptools; nginx's own
code), and the system calls are counted per relayed chunk. py-spy (`loadtest.hotspots`) says which Python
function runs; this says how much of a chunk is the kernel's work, which a C proxy pays too. Needs `perf` and
`strace` (Debian: linux-perf, strace); under either, every figure is slower than in `make bench`, so read the
split and the counts, not the totals. Imports nothing from `gateway`.

    python -m loadtest.cpusplit [--lean] [--requests 576] [--frequency 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path

from loadtest.loadgen import run_load
from loadtest.nginx import nginx_binary
from loadtest.overhead import GATEWAY, NGINX, parse_options, start_targets, workloads
from loadtest.processes import process_tree
from loadtest.stub_engine import MODEL

KERNEL = "[kernel.kallsyms]"
_DSO_ROW = re.compile(r"^\s+([0-9.]+)%\s+(\S+)\s*$")
_STRACE_ROW = re.compile(r"^\s*[0-9.]+\s+[0-9.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?(\w+)\s*$")


@dataclass(frozen=True, slots=True)
class CpuSplit:
    """CPU seconds a process spent while sampled, in all and by shared object."""

    seconds: float
    by_object: dict[str, float]


def parse_perf_dso(report: str) -> CpuSplit:
    """`perf report --no-children --sort dso -g none --stdio` of a cpu-clock recording, as CPU seconds."""
    found = re.search(r"Event count \(approx\.\): (\d+)", report)
    if found is None:
        raise ValueError("no event count in the perf report")
    seconds = int(found.group(1)) / 1e9  # cpu-clock counts nanoseconds
    shares = {m.group(2): float(m.group(1)) / 100 for m in map(_DSO_ROW.match, report.splitlines()) if m}
    return CpuSplit(seconds, {name: share * seconds for name, share in shares.items()})


def parse_strace_counts(summary: str) -> dict[str, int]:
    """Calls per system call from `strace -c`'s summary table."""
    counts: dict[str, int] = {}
    for line in summary.splitlines():
        found = _STRACE_ROW.match(line)
        if found is not None and found.group(2) != "total":
            counts[found.group(2)] = int(found.group(1))
    return counts


def _recorded(argv: list[str], pids: list[int]) -> tuple[Callable[[], None], Callable[[], None]]:
    """Start and stop callables for a recorder attached to `pids` (started when the measured requests begin)."""
    started: list[subprocess.Popen[bytes]] = []

    def start() -> None:
        attach = ["-p", ",".join(map(str, pids))]  # perf and strace both take a comma-separated list
        started.append(subprocess.Popen([*argv, *attach], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        time.sleep(0.5)  # attached before the first measured request

    def stop() -> None:
        for recorder in started:
            recorder.send_signal(signal.SIGINT)
            recorder.wait(timeout=60)

    return start, stop


def _drive(
    url: str,
    body: bytes,
    concurrency: int,
    requests: int,
    headers: dict[str, str] | None,
    recorder: tuple[Callable[[], None], Callable[[], None]] | None = None,
) -> int:
    start, stop = recorder or (None, None)
    result = asyncio.run(
        run_load(
            url,
            body,
            concurrency=concurrency,
            duration=120.0,
            max_requests=requests,
            stream=True,
            headers=headers,
            on_start=start,
            on_end=stop,
        )
    )
    if result.errors:
        raise SystemExit(f"{result.errors} streams failed: {result.first_error}")
    return result.requests


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: drive the streams through each target under perf, then under strace, and print the tables."""
    parser = argparse.ArgumentParser(prog="python -m loadtest.cpusplit", description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=576, help="streams relayed per target and tool")
    parser.add_argument("--frequency", type=int, default=2000, help="perf samples per second")
    ours, rest = parser.parse_known_args(argv)
    for tool in ("perf", "strace"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} is not installed (Debian: apt-get install linux-perf strace)")
    if nginx_binary() is None:
        raise SystemExit("nginx is not installed (apt-get install nginx-light): it is the reference here")
    options, _ = parse_options(list(rest))
    options = replace(options, nginx=True)
    workload = [w for w in workloads(options) if w.stream][-1]
    body = workload.body(MODEL)
    lines = [
        f"Where a relayed stream's CPU goes ({options.label}): {ours.requests} streams of {workload.chunks} chunks "
        f"at c={workload.concurrency} through each target",
        "",
        "| target | CPU s (perf) | µs a chunk, request costs included | kernel | by shared object (CPU s) "
        "| system calls a chunk (strace -c) |",
        "|---|---|---|---|---|---|",
    ]
    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="loadtest-cpusplit-")))
        targets = start_targets(options, stack)
        for name in (GATEWAY, NGINX):
            url, pids = targets.urls[name], process_tree(targets.pids[name])
            _drive(url, body, workload.concurrency, workload.concurrency, targets.headers)  # warm
            data = work / f"{name}.data"
            perf = ["perf", "record", "-F", str(ours.frequency), "-o", str(data)]
            streams = _drive(url, body, workload.concurrency, ours.requests, targets.headers, _recorded(perf, pids))
            report = subprocess.run(
                ["perf", "report", "-i", str(data), "--no-children", "--sort", "dso", "-g", "none", "--stdio"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            split = parse_perf_dso(report)
            counts_file = work / f"{name}.strace"
            strace = ["strace", "-c", "-f", "-o", str(counts_file)]
            traced = _drive(url, body, workload.concurrency, ours.requests, targets.headers, _recorded(strace, pids))
            counts = parse_strace_counts(counts_file.read_text())
            chunks, traced_chunks = streams * workload.chunks, traced * workload.chunks
            objects = sorted(split.by_object.items(), key=lambda item: -item[1])
            shown = ", ".join(f"{obj} {sec:.3f}" for obj, sec in objects[:5])
            calls = sorted(counts.items(), key=lambda item: -item[1])
            per_chunk = ", ".join(f"{call} {n / traced_chunks:.2f}" for call, n in calls[:5])
            kernel = split.by_object.get(KERNEL, 0.0) / split.seconds if split.seconds else 0.0
            lines.append(
                f"| {name} | {split.seconds:.3f} | {split.seconds / chunks * 1e6:.1f} | {kernel:.0%} | {shown} "
                f"| {per_chunk} |"
            )
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
