"""One measured point: warm-up (discarded), a telemetry snapshot, the measured phase, another snapshot.

A point is one load shape (fixed concurrency, or a Poisson rate) against one target, optionally labelled
with the engine profile it ran on. `run`, `sweep` and `profiles` are all lists of points.
Imports nothing from `gateway`; the target is spoken to over HTTP only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from loadtest.loadgen import Phase, drive_closed, drive_open, open_session
from loadtest.progress import LiveProgress
from loadtest.summary import Objectives, Summary, summarize
from loadtest.telemetry import Snapshot, metrics_delta, server_side, snapshot
from loadtest.timing import RequestTiming
from loadtest.traffic import Traffic

# Warm-up requests use their own prompts (indices from here), so they cannot warm the prefix cache for
# the measured ones.
WARMUP_FIRST_INDEX = 1_000_000_000
_MODELS_TIMEOUT = 30.0


class TargetError(RuntimeError):
    """The target does not answer as an OpenAI-compatible server would (e.g. no model in /v1/models)."""


@dataclass(frozen=True, slots=True)
class Target:
    """An OpenAI-compatible server: its root URL (no `/v1`), the Bearer key, whether to scrape `/metrics`."""

    base_url: str
    api_key: str | None = None
    scrape_metrics: bool = True

    @classmethod
    def from_url(cls, url: str, api_key: str | None = None, *, scrape_metrics: bool = True) -> Target:
        """Accepts `http://host:port` or the OpenAI SDK's `http://host:port/v1`."""
        root = url.rstrip("/")
        root = root.removesuffix("/v1")
        return cls(root, api_key or None, scrape_metrics)

    def url(self, path: str) -> str:
        """An absolute URL on the target."""
        return self.base_url + path

    @property
    def headers(self) -> dict[str, str]:
        """The Authorization header when there is a key."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(frozen=True, slots=True)
class LoadShape:
    """Closed loop at `concurrency`, or open loop at `rate` requests/s (optionally capped in flight)."""

    concurrency: int | None = None
    rate: float | None = None
    max_concurrency: int | None = None

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.rate is None):
            raise ValueError("a load shape has a concurrency or a rate, not both")

    @property
    def label(self) -> str:
        """`c=4` or `rate=2/s`."""
        return f"c={self.concurrency}" if self.concurrency is not None else f"rate={self.rate:g}/s"

    @property
    def level(self) -> float:
        """The concurrency or the rate, for charts."""
        return float(self.concurrency if self.concurrency is not None else self.rate or 0.0)


@dataclass(frozen=True, slots=True)
class Plan:
    """Bounds and objectives shared by every point of a run."""

    requests: int
    duration: float
    warmup: int = 0
    timeout: float = 120.0
    objectives: Objectives = field(default_factory=Objectives)
    progress: bool = True


@dataclass(slots=True)
class Point:
    """One measured point."""

    label: str
    shape: LoadShape
    profile: str | None
    base_url: str
    summary: Summary
    before: Snapshot
    after: Snapshot
    records: list[RequestTiming]

    def as_json(self) -> dict[str, Any]:
        """The point's entry in results.json."""
        delta = metrics_delta(self.before, self.after)
        return {
            "label": self.label,
            "concurrency": self.shape.concurrency,
            "rate": self.shape.rate,
            "max_concurrency": self.shape.max_concurrency,
            "profile": self.profile,
            "base_url": self.base_url,
            "summary": self.summary.as_json(),
            "telemetry": {
                "before": self.before.as_json(),
                "after": self.after.as_json(),
                "metrics_delta": delta,
                "server_side": server_side(delta),
                "gpu_used_mib_after": self.after.gpu_used_mib(),
            },
            "requests": [r.as_json() for r in sorted(self.records, key=lambda r: r.index)],
        }


async def fetch_model(target: Target) -> str:
    """The first model id the target lists at /v1/models."""
    async with open_session(connections=1, timeout=_MODELS_TIMEOUT, headers=target.headers) as http:
        try:
            async with http.get(target.url("/v1/models")) as answer:
                body = await answer.read()
                status = answer.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise TargetError(f"{target.base_url}/v1/models: {type(exc).__name__}: {exc}") from None
    if status != 200:
        raise TargetError(f"{target.base_url}/v1/models answered {status}: {body[:200]!r}")
    try:
        models = orjson.loads(body).get("data") or []
        return str(models[0]["id"])
    except (ValueError, AttributeError, IndexError, KeyError, TypeError):
        raise TargetError(f"{target.base_url}/v1/models lists no model: {body[:200]!r}") from None


async def _drive(
    http: aiohttp.ClientSession,
    url: str,
    traffic: Traffic,
    shape: LoadShape,
    *,
    count: int,
    duration: float,
    first_index: int,
    progress: LiveProgress | None,
) -> Phase:
    on_done = progress.record if progress is not None else None
    if shape.concurrency is not None:
        return await drive_closed(
            http,
            url,
            traffic.body,
            stream=traffic.stream,
            concurrency=shape.concurrency,
            max_requests=count,
            duration=duration,
            first_index=first_index,
            on_done=on_done,
        )
    return await drive_open(
        http,
        url,
        traffic.body,
        stream=traffic.stream,
        rate=shape.rate or 1.0,
        max_requests=count,
        duration=duration,
        seed=traffic.seed + first_index,
        max_concurrency=shape.max_concurrency,
        first_index=first_index,
        on_done=on_done,
    )


async def run_point(
    target: Target, traffic: Traffic, shape: LoadShape, plan: Plan, *, profile: str | None = None, first_index: int = 0
) -> Point:
    """Warm up, snapshot, measure, snapshot; requests are numbered from `first_index` (their prompts follow)."""
    connections = shape.concurrency or shape.max_concurrency or 0
    label = profile or shape.label
    metrics_url = target.url("/metrics") if target.scrape_metrics else None
    url = target.url(traffic.path)
    async with open_session(connections=connections, timeout=plan.timeout, headers=target.headers) as http:
        if plan.warmup:
            await _drive(
                http,
                url,
                traffic,
                shape,
                count=plan.warmup,
                duration=plan.duration,
                first_index=WARMUP_FIRST_INDEX + first_index,
                progress=None,
            )
        before = await snapshot(http, metrics_url)
        with LiveProgress(label, plan.requests, enabled=plan.progress) as progress:
            phase = await _drive(
                http,
                url,
                traffic,
                shape,
                count=plan.requests,
                duration=plan.duration,
                first_index=first_index,
                progress=progress,
            )
        after = await snapshot(http, metrics_url)
    summary = summarize(phase, plan.objectives)
    return Point(label, shape, profile, target.base_url, summary, before, after, phase.records)
