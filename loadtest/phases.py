"""One measured phase: a workload sent to one target while the CPU time of the processes involved is metered.

CPU comes from each process's CPU-time clock (the scheduler's nanosecond count, every thread) before and after
the measured requests: the figure that survives a noisy machine, unlike latency and throughput. Imports nothing
from `gateway`.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import orjson

from loadtest.loadgen import LoadResult, run_load
from loadtest.processes import run_queue_wait_seconds, run_seconds, system_seconds, tree_sum
from loadtest.stub_engine import MODEL

LOADGEN = "loadgen"


@dataclass(frozen=True, slots=True)
class Workload:
    """What is sent: chat completions, streamed with `chunks` content chunks or not, at a fixed concurrency."""

    name: str
    concurrency: int
    stream: bool
    chunks: int

    def body(self, model: str) -> bytes:
        """The request body (the same bytes for every target)."""
        data: dict[str, Any] = {
            "model": model,
            "messages": [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "Write one short sentence about benchmarks."},
            ],
            "max_tokens": self.chunks,
            "temperature": 0.0,
        }
        if self.stream:
            data["stream"] = True
            data["stream_options"] = {"include_usage": True}
        return orjson.dumps(data)


@dataclass(frozen=True, slots=True)
class PhaseRecord:
    """One phase's client-side figures and the CPU seconds each metered process spent in it."""

    round: int
    workload: str
    target: str
    concurrency: int
    stream: bool
    chunks: int
    requests: int
    errors: int
    first_error: str | None
    wall_s: float
    rps: float
    p50_ms: float
    p99_ms: float
    first_byte_p50_ms: float
    reads_per_request: float
    cpu_s: dict[str, float]
    sys_s: dict[str, float]
    wait_s: dict[str, float]

    def cpu_per_request_ms(self, process: str) -> float:
        """CPU milliseconds `process` spent per completed request in this phase."""
        return self.cpu_s[process] * 1000 / self.requests if self.requests else float("nan")

    def sys_share(self, process: str) -> float:
        """The kernel's share of `process`'s CPU time (syscalls; on loopback also the peer's TCP receive path)."""
        return self.sys_s[process] / self.cpu_s[process] if self.cpu_s[process] else float("nan")

    def waiting(self, process: str) -> float:
        """Seconds `process`'s event loop waited for a CPU per wall second (0 on a quiet machine)."""
        return self.wait_s[process] / self.wall_s if self.wall_s else float("nan")

    def busy(self, *processes: str) -> float:
        """CPU seconds of `processes` per wall second (1.0 = one core fully used)."""
        return sum(self.cpu_s[p] for p in processes) / self.wall_s if self.wall_s else float("nan")


@dataclass(frozen=True, slots=True)
class CpuSnapshot:
    """Counters so far, per process name: CPU (user + system), system alone, run-queue wait; all seconds."""

    cpu: dict[str, float]
    sys: dict[str, float]
    wait: dict[str, float]


class CpuMeter:
    """Snapshots the CPU seconds of named processes (each with its descendants: a gateway's forked workers) and of
    this one (the load generator)."""

    def __init__(self, pids: Mapping[str, int]) -> None:
        self._pids = dict(pids)

    def snapshot(self) -> CpuSnapshot:
        """The counters of every metered process now: CPU from the scheduler's nanosecond count, the system part
        from /proc/<pid>/stat's ticks (its share only is shown: the ticks are too coarse for a phase's total)."""
        metered = self._pids.items()
        cpu = {name: tree_sum(pid, run_seconds) for name, pid in metered}
        system = {name: tree_sum(pid, system_seconds) for name, pid in metered}
        wait = {name: tree_sum(pid, run_queue_wait_seconds) for name, pid in metered}
        # The load generator alone, not the processes it started.
        own = os.getpid()
        cpu[LOADGEN], system[LOADGEN], wait[LOADGEN] = run_seconds(own), os.times().system, run_queue_wait_seconds(own)
        return CpuSnapshot(cpu=cpu, sys=system, wait=wait)

    @staticmethod
    def delta(before: CpuSnapshot, after: CpuSnapshot) -> CpuSnapshot:
        """What was spent between two snapshots."""
        return CpuSnapshot(
            cpu={name: value - before.cpu[name] for name, value in after.cpu.items()},
            sys={name: value - before.sys[name] for name, value in after.sys.items()},
            wait={name: value - before.wait[name] for name, value in after.wait.items()},
        )


async def run_phase(
    round_no: int,
    workload: Workload,
    target: str,
    url: str,
    meter: CpuMeter,
    *,
    duration: float,
    max_requests: int,
    headers: Mapping[str, str] | None = None,
) -> PhaseRecord:
    """Run `workload` against `url` for `duration` seconds (at most `max_requests`) and meter it."""
    before: list[CpuSnapshot] = []
    after: list[CpuSnapshot] = []
    result: LoadResult = await run_load(
        url,
        workload.body(MODEL),
        concurrency=workload.concurrency,
        duration=duration,
        max_requests=max_requests,
        stream=workload.stream,
        on_start=lambda: before.append(meter.snapshot()),
        on_end=lambda: after.append(meter.snapshot()),
        headers=headers,
    )
    spent = CpuMeter.delta(before[0], after[0])
    return PhaseRecord(
        round=round_no,
        workload=workload.name,
        target=target,
        concurrency=workload.concurrency,
        stream=workload.stream,
        chunks=workload.chunks,
        requests=result.requests,
        errors=result.errors,
        first_error=result.first_error,
        wall_s=result.wall_s,
        rps=result.rps,
        p50_ms=result.latency_ms(0.5),
        p99_ms=result.latency_ms(0.99),
        first_byte_p50_ms=result.first_byte_ms(0.5),
        reads_per_request=result.body_reads / result.requests if result.requests else float("nan"),
        cpu_s=spent.cpu,
        sys_s=spent.sys,
        wait_s=spent.wait,
    )


def pick(records: Iterable[PhaseRecord], workload: str, target: str) -> list[PhaseRecord]:
    """The records of one workload against one target, in round order."""
    return [r for r in records if r.workload == workload and r.target == target]


def chunk_cost_us(records: list[PhaseRecord], target: str, streams: tuple[Workload, Workload]) -> float:
    """µs of `target`'s CPU per relayed chunk: per round, the slope between two chunk counts; then the median."""
    return median(_round_chunk_costs(records, target, streams).values())


def chunk_cost_ratio(
    records: list[PhaseRecord], target: str, reference: str, streams: tuple[Workload, Workload]
) -> float:
    """`target`'s CPU per relayed chunk as a multiple of `reference`'s: per round, the ratio of their slopes (the two
    measured seconds apart, under the same state of the machine), then the median; rounds where the reference's
    slope is not positive are left out. A ratio of the two medians would pair one round's target with another's
    reference, and a machine that drifts between rounds moves it."""
    ours = _round_chunk_costs(records, target, streams)
    theirs = _round_chunk_costs(records, reference, streams)
    return median(ours[k] / theirs[k] for k in ours if k in theirs and theirs[k] > 0)


def _round_chunk_costs(records: list[PhaseRecord], target: str, streams: tuple[Workload, Workload]) -> dict[int, float]:
    """Per round, µs of `target`'s CPU per relayed chunk: the slope between the two chunk counts."""
    few, many = streams
    cost = {w.chunks: {r.round: r.cpu_per_request_ms(target) for r in pick(records, w.name, target)} for w in streams}
    span = many.chunks - few.chunks
    return {
        k: (cost[many.chunks][k] - cost[few.chunks][k]) * 1000 / span
        for k in cost[many.chunks]
        if k in cost[few.chunks]
    }


def median(values: Iterable[float]) -> float:
    """The median, NaN for none."""
    items = list(values)
    return statistics.median(items) if items else float("nan")


def records_json(records: Iterable[PhaseRecord]) -> list[dict[str, Any]]:
    """Phase records as plain dicts for a JSON report."""
    return [asdict(record) for record in records]
