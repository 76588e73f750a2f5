"""Aggregates of one measured phase: percentiles, throughput, goodput against objectives, errors by outcome.

Latency-type figures are over the requests that succeeded; error counts are over all of them.
Imports nothing from `gateway`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

from loadtest.loadgen import Phase
from loadtest.timing import RequestTiming, percentile


@dataclass(frozen=True, slots=True)
class Distribution:
    """Nearest-rank percentiles, mean and max of one figure; None where there were no values."""

    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None
    max: float | None

    @classmethod
    def of(cls, values: Iterable[float | None], scale: float = 1.0) -> Distribution:
        """Of the values that are not None, each multiplied by `scale` (1000: seconds to ms)."""
        got = [v * scale for v in values if v is not None]
        if not got:
            return cls(0, None, None, None, None, None)
        return cls(
            count=len(got),
            mean=round(sum(got) / len(got), 3),
            p50=round(percentile(got, 0.5), 3),
            p90=round(percentile(got, 0.9), 3),
            p99=round(percentile(got, 0.99), 3),
            max=round(max(got), 3),
        )


@dataclass(frozen=True, slots=True)
class Objectives:
    """Service-level objectives a request must meet to count as goodput (None: not set)."""

    ttft_ms: float | None = None
    latency_ms: float | None = None

    def met_by(self, record: RequestTiming) -> bool:
        """Succeeded within every objective that is set (a TTFT objective needs a streamed TTFT)."""
        if not record.ok:
            return False
        if self.latency_ms is not None and record.latency * 1000 > self.latency_ms:
            return False
        if self.ttft_ms is not None and (record.ttft is None or record.ttft * 1000 > self.ttft_ms):
            return False
        return True


@dataclass(frozen=True, slots=True)
class Goodput:
    """Requests that met the objectives: how many, their share of all measured requests, per second."""

    slo_ttft_ms: float | None
    slo_latency_ms: float | None
    requests: int
    fraction: float | None
    per_s: float


@dataclass(frozen=True, slots=True)
class Summary:
    """What results.json's `summary` holds (times in ms, rates per second)."""

    requests: int
    ok: int
    errors: dict[str, int]
    first_errors: dict[str, str]
    wall_s: float
    requests_per_s: float
    output_tokens: int
    output_tokens_per_s: float
    prompt_tokens: int | None
    usage_reported: int
    latency_ms: Distribution
    ttft_ms: Distribution
    itl_mean_ms: Distribution
    itl_p99_ms: Distribution
    tpot_ms: Distribution
    stream_tokens_per_s: Distribution
    dispatch_lag_ms: Distribution
    goodput: Goodput

    def as_json(self) -> dict[str, Any]:
        """Plain dicts for results.json."""
        return asdict(self)


def summarize(phase: Phase, objectives: Objectives) -> Summary:
    """The aggregates of `phase`."""
    records = phase.records
    ok = [r for r in records if r.ok]
    errors = Counter(r.outcome for r in records if not r.ok)
    first_errors: dict[str, str] = {}
    for record in records:
        if not record.ok and record.outcome not in first_errors:
            first_errors[record.outcome] = (record.detail or "")[:300]
    wall = phase.wall_s
    output_tokens = sum(r.output_tokens for r in ok)
    prompts = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    good = sum(1 for r in records if objectives.met_by(r))

    def dist(get: Callable[[RequestTiming], float | None], scale: float = 1000.0) -> Distribution:
        return Distribution.of((get(r) for r in ok), scale)

    return Summary(
        requests=len(records),
        ok=len(ok),
        errors=dict(sorted(errors.items())),
        first_errors=first_errors,
        wall_s=round(wall, 3),
        requests_per_s=round(len(ok) / wall, 3) if wall > 0 else 0.0,
        output_tokens=output_tokens,
        output_tokens_per_s=round(output_tokens / wall, 3) if wall > 0 else 0.0,
        prompt_tokens=sum(prompts) if prompts else None,
        usage_reported=sum(1 for r in ok if r.usage_reported),
        latency_ms=dist(lambda r: r.latency),
        ttft_ms=dist(lambda r: r.ttft),
        itl_mean_ms=dist(lambda r: r.itl_mean),
        itl_p99_ms=dist(lambda r: r.itl_p99),
        tpot_ms=dist(lambda r: r.tpot),
        stream_tokens_per_s=dist(_decode_rate, scale=1.0),
        dispatch_lag_ms=Distribution.of((r.sent_at - r.scheduled_at for r in records), 1000.0),
        goodput=Goodput(
            slo_ttft_ms=objectives.ttft_ms,
            slo_latency_ms=objectives.latency_ms,
            requests=good,
            fraction=round(good / len(records), 4) if records else None,
            per_s=round(good / wall, 3) if wall > 0 else 0.0,
        ),
    )


def _decode_rate(record: RequestTiming) -> float | None:
    """Tokens per second of one stream after its first token (what one user sees)."""
    tpot = record.tpot
    return 1 / tpot if tpot else None
