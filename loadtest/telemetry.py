"""What the target and this machine report around a measured phase: a few Prometheus series and GPU memory.

`/metrics` is read over HTTP (the gateway's `nemotron_gateway_*` series, or a vLLM engine's `vllm:*` ones);
GPU memory through NVML (nvidia-ml-py), so it is this machine's GPUs: meaningful when the engine runs here.
Either is None when it cannot be read. The untyped `pynvml` stays inside this module. Imports nothing from
`gateway`.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

try:
    import pynvml  # type: ignore[import-untyped]  # nvidia-ml-py ships no type information
except ImportError:  # not installed: GPU memory reads as unavailable
    pynvml = None

# Series kept from a scrape; counters (`_total`, `_sum`, `_count`) also get a before/after delta.
SERIES = (
    "nemotron_gateway_requests_total",
    "nemotron_gateway_tokens_total",
    "nemotron_gateway_requests_in_flight",
    "nemotron_gateway_engine_errors_total",
    "nemotron_gateway_client_disconnects_total",
    "nemotron_gateway_engine_up",
    "nemotron_gateway_time_to_first_token_seconds_sum",
    "nemotron_gateway_time_to_first_token_seconds_count",
    "nemotron_gateway_request_duration_seconds_sum",
    "nemotron_gateway_request_duration_seconds_count",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
)
_COUNTER_SUFFIXES = ("_total", "_sum", "_count")
_SCRAPE_TIMEOUT = 5.0


@dataclass(frozen=True, slots=True)
class GpuMemory:
    """One GPU's memory as NVML reports it, in MiB."""

    index: int
    name: str
    used_mib: float
    total_mib: float


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Metrics (series name with labels → value) and GPU memory at one moment; None where unreadable."""

    at: float
    metrics: dict[str, float] | None
    gpus: list[GpuMemory] | None

    def gpu_used_mib(self) -> float | None:
        """Memory in use on all of this machine's GPUs together, or None without NVML."""
        return None if self.gpus is None else sum(g.used_mib for g in self.gpus)

    def as_json(self) -> dict[str, Any]:
        """For results.json."""
        return {
            "at": round(self.at, 3),
            "metrics": self.metrics,
            "gpus": None if self.gpus is None else [asdict(g) for g in self.gpus],
        }


def parse_metrics(text: str, names: tuple[str, ...] = SERIES) -> dict[str, float]:
    """The samples of `names` in Prometheus text, keyed `name{label="value",...}` (labels sorted)."""
    wanted = set(names)
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name not in wanted:
                continue
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = float(sample.value)
    return samples


def metrics_delta(before: Snapshot, after: Snapshot) -> dict[str, float] | None:
    """After minus before for the counters read both times (None unless both scrapes worked)."""
    if before.metrics is None or after.metrics is None:
        return None
    delta: dict[str, float] = {}
    for key, value in after.metrics.items():
        name = key.split("{", 1)[0]
        if name.endswith(_COUNTER_SUFFIXES):
            delta[key] = round(value - before.metrics.get(key, 0.0), 6)
    return delta


def server_side(delta: dict[str, float] | None) -> dict[str, float | None]:
    """The server's view of the phase from the deltas: the gateway's requests, mean TTFT and duration (ms);
    the engine's generated tokens and preemptions. Only for the series the target exports."""
    if not delta:
        return {}

    def total(name: str, label: str = "") -> float:
        return sum(v for k, v in delta.items() if k.split("{", 1)[0] == name and label in k)

    def mean_ms(prefix: str) -> float | None:
        count = total(f"{prefix}_count")
        return round(total(f"{prefix}_sum") / count * 1000, 3) if count else None

    derived: dict[str, float | None] = {}
    if any(key.startswith("nemotron_gateway_") for key in delta):
        # The API routes only: the scrapes themselves (/metrics) and probes (/ready) are counted too.
        derived["gateway_requests"] = total("nemotron_gateway_requests_total", 'route="/v1/')
        derived["gateway_client_disconnects"] = total("nemotron_gateway_client_disconnects_total")
        derived["gateway_ttft_mean_ms"] = mean_ms("nemotron_gateway_time_to_first_token_seconds")
        derived["gateway_duration_mean_ms"] = mean_ms("nemotron_gateway_request_duration_seconds")
    if any(key.startswith("vllm:") for key in delta):
        derived["engine_generation_tokens"] = total("vllm:generation_tokens_total")
        derived["engine_preemptions"] = total("vllm:num_preemptions_total")
    return derived


async def scrape(http: aiohttp.ClientSession, url: str) -> dict[str, float] | None:
    """The kept series from `url` (a `/metrics` URL), or None when it does not answer 200 Prometheus text."""
    try:
        async with http.get(url, timeout=aiohttp.ClientTimeout(total=_SCRAPE_TIMEOUT)) as answer:
            if answer.status != 200:
                return None
            text = await answer.text()
    except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
        return None
    try:
        return parse_metrics(text)
    except ValueError:
        return None


def gpu_memory() -> list[GpuMemory] | None:
    """Memory of every GPU NVML sees, or None without NVML (no driver, no GPU, nvidia-ml-py missing)."""
    if pynvml is None:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        found = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            name = pynvml.nvmlDeviceGetName(handle)
            found.append(
                GpuMemory(
                    index=index,
                    name=name.decode() if isinstance(name, bytes) else str(name),
                    used_mib=round(memory.used / 2**20, 1),
                    total_mib=round(memory.total / 2**20, 1),
                )
            )
        return found
    except pynvml.NVMLError:
        return None
    finally:
        pynvml.nvmlShutdown()


async def snapshot(http: aiohttp.ClientSession, metrics_url: str | None) -> Snapshot:
    """Scrape `metrics_url` (if any) and read GPU memory (in a thread: NVML calls block)."""
    metrics = await scrape(http, metrics_url) if metrics_url else None
    gpus = await asyncio.to_thread(gpu_memory)
    return Snapshot(time.time(), metrics, gpus)
