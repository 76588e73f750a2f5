"""Every Prometheus object the gateway exports, built into one registry per app.

A leaf: imports no other gateway module. Names are `nemotron_gateway_<noun>_<unit>`; never the
engine's `vllm:` prefix, never a secret as a label.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

# Latency buckets from 5 ms to 10 min: a non-streamed completion may legitimately take minutes.
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60)
# Inter-token latency: a GPU engine streams a token every ~5-50 ms; a CPU test engine far slower.
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1, 2.5, 5)
# A Redis call takes ~0.1-1 ms on the same machine; its deadline (redis.command_timeout) is ~1 s.
_REDIS_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class GatewayMetrics:
    """The gateway's metrics in their own registry (several apps may live in one process in tests)."""

    def __init__(self, registry: CollectorRegistry | None = None, *, per_key: bool = True) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        # The process's RSS, CPU, open fds and the interpreter's GC, as every Python exporter has them.
        for collector in (ProcessCollector, PlatformCollector, GCCollector):
            collector(registry=r)
        self.per_key = per_key
        # Per-key children looked up once per key (labels() per request showed in the profile); see forget_key.
        self._keys: dict[str, _KeyChildren] = {}
        # Keys revoked or changed since they last counted (see forget_key).
        self.forgotten: set[str] = set()
        self.requests = Counter(
            "nemotron_gateway_requests",
            "Requests answered, by route and HTTP status.",
            ["route", "status"],
            registry=r,
        )
        self.request_duration = Histogram(
            "nemotron_gateway_request_duration_seconds",
            "Time from request start to the last byte sent, by route.",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.time_to_first_token = Histogram(
            "nemotron_gateway_time_to_first_token_seconds",
            "Time from request start to the first streamed chunk from the engine.",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.tokens = Counter(
            "nemotron_gateway_tokens",
            "Tokens processed as the engine reported them, by kind (prompt, completion).",
            ["kind"],
            registry=r,
        )
        self.api_requests = Counter(
            "nemotron_gateway_api_requests",
            "Requests of the relayed APIs answered, by API (chat, completions, responses, messages) and HTTP status.",
            ["api", "status"],
            registry=r,
        )
        self.api_tokens = Counter(
            "nemotron_gateway_api_tokens",
            "Tokens the engine reported, by API and kind (prompt, completion, reasoning: part of completion).",
            ["api", "kind"],
            registry=r,
        )
        self.in_flight = Gauge(
            "nemotron_gateway_requests_in_flight",
            "Requests being served right now.",
            registry=r,
            multiprocess_mode="livesum",  # several workers: the sum over the living ones
        )
        self.client_disconnects = Counter(
            "nemotron_gateway_client_disconnects",
            "Requests whose client went away before the answer was complete, by mode (stream, non_stream, "
            "upload: while sending its body).",
            ["mode"],
            registry=r,
        )
        self.engine_errors = Counter(
            "nemotron_gateway_engine_errors",
            "Failures talking to the engine, by kind (refused, connection_lost, timeout, protocol, error_status, "
            "mid_stream, frozen), by replica and the model it serves.",
            ["replica", "model", "kind"],
            registry=r,
        )
        self.engine_up = Gauge(
            "nemotron_gateway_engine_up",
            "1 while every model the gateway serves has a ready replica, else 0.",
            registry=r,
            multiprocess_mode="livemin",  # several workers: 0 if any of them finds a model without one
        )
        self.replica_up = Gauge(
            "nemotron_gateway_replica_up",
            "1 while the replica is ready (it answers /health, its model is known, it generates), else 0; by replica "
            "(its URL) and the model it serves.",
            ["replica", "model"],
            registry=r,
            multiprocess_mode="livemin",
        )
        self.replica_drained = Gauge(
            "nemotron_gateway_replica_drained",
            "1 while an operator has drained the replica (it takes no new requests), else 0.",
            ["replica", "model"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.model_ready_replicas = Gauge(
            "nemotron_gateway_model_ready_replicas",
            "Ready, undrained replicas of each served model (0: the model cannot be served).",
            ["model"],
            registry=r,
            multiprocess_mode="livemin",
        )
        self.replica_requests = Counter(
            "nemotron_gateway_replica_requests",
            "Requests sent to each replica, by the model, the replica and the answer's HTTP status.",
            ["model", "replica", "status"],
            registry=r,
        )
        self.replica_tokens = Counter(
            "nemotron_gateway_replica_tokens",
            "Tokens the replica reported, by model, replica and kind (prompt, completion).",
            ["model", "replica", "kind"],
            registry=r,
        )
        self.replica_request_duration = Histogram(
            "nemotron_gateway_replica_request_duration_seconds",
            "Time from a request's start to the last byte sent, by the model and the replica that answered it.",
            ["model", "replica"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.replica_time_to_first_token = Histogram(
            "nemotron_gateway_replica_time_to_first_token_seconds",
            "Seconds from the request's arrival to its first streamed chunk, by model and replica.",
            ["model", "replica"],
            registry=r,
            buckets=_TTFT_BUCKETS,
        )
        self.replica_inter_token_latency = Histogram(
            "nemotron_gateway_replica_inter_token_latency_seconds",
            "Mean time between two completion tokens of a stream, per stream, by model and replica.",
            ["model", "replica"],
            registry=r,
            buckets=_ITL_BUCKETS,
        )
        self.routed = Counter(
            "nemotron_gateway_routed",
            "Requests given a replica, by model and how it was picked (affinity: the conversation's replica; spill: "
            "its replica was overloaded; least_loaded; round_robin; failover: tried again on another replica after "
            "its first one refused it before the first byte).",
            ["model", "how"],
            registry=r,
        )
        self.redis_up = Gauge(
            "nemotron_gateway_redis_up",
            "1 when the last Redis ping succeeded, else 0.",
            registry=r,
            multiprocess_mode="livemin",
        )
        self.rate_limited = Counter(
            "nemotron_gateway_rate_limited",
            "Requests refused 429, by the exhausted limit (requests, tokens, concurrency, budget: a spent token "
            "budget, engine_queue: a priority tier's bound on the engine's queue, failed_auth: an address blocked "
            "for guessing keys).",
            ["limit"],
            registry=r,
        )
        self.auth_failures = Counter(
            "nemotron_gateway_auth_failures",
            "Requests refused 401, by cause class (missing, malformed, unknown, inactive, blocked); never key "
            "material.",
            ["cause"],
            registry=r,
        )
        self.inter_token_latency = Histogram(
            "nemotron_gateway_inter_token_latency_seconds",
            "Mean time between two completion tokens of a stream (first chunk to end over tokens - 1), per stream.",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.key_requests = Counter(
            "nemotron_gateway_key_requests",
            "Requests of an authenticated key, by key name and HTTP status (NEMOTRON_METRICS__PER_KEY).",
            ["key", "status"],
            registry=r,
        )
        self.key_tokens = Counter(
            "nemotron_gateway_key_tokens",
            "Tokens the engine reported for a key's requests, by key name and kind (NEMOTRON_METRICS__PER_KEY).",
            ["key", "kind"],
            registry=r,
        )
        # Token budgets: the last figures this gateway saw at an admission (several workers: the most recent one).
        self.key_budget = Gauge(
            "nemotron_gateway_key_budget_tokens",
            "A key's token budget, by key name and window (day, month; NEMOTRON_METRICS__PER_KEY).",
            ["key", "window"],
            registry=r,
            multiprocess_mode="livemostrecent",
        )
        self.key_budget_used = Gauge(
            "nemotron_gateway_key_budget_used_tokens",
            "Tokens a key used of its budget in the current window (charged up front, reconciled at the end), by key "
            "name and window, as of its last admission.",
            ["key", "window"],
            registry=r,
            multiprocess_mode="livemostrecent",
        )
        # Key name -> window -> (budget, used) children, looked up once (see set_key_budget).
        self._budget_children: dict[str, dict[str, tuple[Any, Any]]] = {}
        self.redis_call_duration = Histogram(
            "nemotron_gateway_redis_call_duration_seconds",
            "Time of one Redis call through the gateway's Redis boundary, retry included.",
            buckets=_REDIS_BUCKETS,
            registry=r,
        )
        self.redis_errors = Counter(
            "nemotron_gateway_redis_errors",
            "Redis calls that failed (after the one retry), answered as the key store being unavailable.",
            registry=r,
        )
        self.admission_refused = Counter(
            "nemotron_gateway_admission_refused",
            "Requests refused before vLLM's queue, by priority tier (0: most urgent; NEMOTRON_ADMISSION__SHARES) and "
            "reason (waiting: 429, the tier's bound on waiting requests; kv_cache: 503, the KV-cache bound; "
            "engine_queue: 503, vLLM's own --max-num-queued-reqs refused it, tier 'all'); by replica and the model "
            "it serves.",
            ["replica", "model", "tier", "reason"],
            registry=r,
        )
        self.engine_load = Gauge(
            "nemotron_gateway_engine_load",
            "The engine's load as this gateway last read it from vLLM's /metrics: waiting and running requests, "
            "KV-cache use (0-1), requests finished per second (drain); by replica and the model it serves.",
            ["replica", "model", "figure"],
            registry=r,
            multiprocess_mode="mostrecent",
        )
        self.priority_sent = Counter(
            "nemotron_gateway_priority_sent",
            "Requests sent to the engine, by the priority tier they were admitted at and whether vLLM's `priority` "
            "field went with them (sent: a priority-scheduling engine; dropped: FCFS); by replica and the model it "
            "serves.",
            ["replica", "model", "tier", "field"],
            registry=r,
        )
        self.trace_spans_exported = Counter(
            "nemotron_gateway_trace_spans_exported",
            "Spans the trace collector took (tracing on: OTEL_EXPORTER_OTLP_ENDPOINT).",
            registry=r,
        )
        self.trace_spans_dropped = Counter(
            "nemotron_gateway_trace_spans_dropped",
            "Spans never exported, by reason (queue_full: the export queue had no room for a request's spans; "
            "export_failed: the collector refused them or did not answer in time; shutdown: still queued when the "
            "gateway stopped). Requests are never slowed for them.",
            ["reason"],
            registry=r,
        )

    def count_api(
        self, api: str, status: int, prompt: int | None, completion: int | None, reasoning: int | None
    ) -> None:
        """Count one request of a relayed API and the tokens the engine reported for it (few, fixed label values)."""
        self.api_requests.labels(api, str(status)).inc()
        if prompt is not None and completion is not None:
            self.api_tokens.labels(api, "prompt").inc(prompt)
            self.api_tokens.labels(api, "completion").inc(completion)
        if reasoning is not None:
            self.api_tokens.labels(api, "reasoning").inc(reasoning)

    def count_replica(
        self,
        model: str,
        replica: str,
        status: int,
        duration: float,
        ttft: float | None,
        prompt: int | None,
        completion: int | None,
        inter_token: float | None = None,
    ) -> None:
        """Count one request a replica answered: its status, duration, time to first token, inter-token latency (a
        stream's) and the tokens it reported."""
        self.replica_requests.labels(model, replica, str(status)).inc()
        self.replica_request_duration.labels(model, replica).observe(duration)
        if ttft is not None:
            self.replica_time_to_first_token.labels(model, replica).observe(ttft)
        if inter_token is not None:
            self.replica_inter_token_latency.labels(model, replica).observe(inter_token)
        if prompt is not None and completion is not None:
            self.replica_tokens.labels(model, replica, "prompt").inc(prompt)
            self.replica_tokens.labels(model, replica, "completion").inc(completion)

    def count_key(self, name: str, status: int, prompt: int | None, completion: int | None) -> None:
        """Count one request of key `name` (nothing when per-key labels are off)."""
        if not self.per_key:
            return
        children = self._keys.get(name)
        if children is None:
            self.forgotten.discard(name)
            children = self._keys[name] = _KeyChildren(
                self.key_tokens.labels(name, "prompt"), self.key_tokens.labels(name, "completion")
            )
        by_status = children.requests.get(status)
        if by_status is None:
            by_status = children.requests[status] = self.key_requests.labels(name, str(status))
        by_status.inc()
        if prompt is not None and completion is not None:
            children.prompt.inc(prompt)
            children.completion.inc(completion)

    def set_key_budget(self, name: str, daily: int, monthly: int, day_used: int, month_used: int) -> None:
        """Export key `name`'s budgets (0: none) and its use of them (nothing when per-key labels are off)."""
        if not self.per_key:
            return
        windows = self._budget_children.get(name)
        if windows is None:
            self.forgotten.discard(name)
            windows = self._budget_children[name] = {}
        for window, budget, used in (("day", daily, day_used), ("month", monthly, month_used)):
            children = windows.get(window)
            if budget:
                if children is None:
                    children = windows[window] = (
                        self.key_budget.labels(name, window),
                        self.key_budget_used.labels(name, window),
                    )
                children[0].set(budget)
                children[1].set(used)
            elif children is not None:
                del windows[window]
                self._remove_budget(name, window)

    def _remove_budget(self, name: str, window: str) -> None:
        for gauge in (self.key_budget, self.key_budget_used):
            _remove_series(gauge, name, window)

    def forget_key(self, name: str) -> None:
        """Stop exporting a key's series (revoked or changed; "*": every key), so per-key cardinality follows the
        live keys. A key still in use starts new series: Prometheus reads the reset as a counter restart."""
        names = list(self._keys) if name == "*" else [name]
        if name != "*":
            # Several workers: the other workers' values of this key stay in the shared files; the scrape drops them.
            self.forgotten.add(name)
        for key in names:
            children = self._keys.pop(key, None)
            if children is None:
                continue
            for status in children.requests:
                _remove_series(self.key_requests, key, str(status))
            for kind in ("prompt", "completion"):
                _remove_series(self.key_tokens, key, kind)
        for key in list(self._budget_children) if name == "*" else [name]:
            for window in self._budget_children.pop(key, {}):
                self._remove_budget(key, window)


def _remove_series(metric: Counter | Gauge, *labels: str) -> None:
    """Stop exporting one labelled series of this process. With several workers prometheus-client warns on every
    removal that it cannot take the series out of the shared files; `forgotten` drops those at the scrape, so the
    warning (printed on every key change and at every shutdown) says nothing new."""
    with warnings.catch_warnings(), contextlib.suppress(KeyError):
        warnings.filterwarnings("ignore", "Removal of labels has not been implemented", UserWarning)
        metric.remove(*labels)


class _KeyChildren:
    """One key's labelled children, created on its first request."""

    __slots__ = ("completion", "prompt", "requests")

    def __init__(self, prompt: Any, completion: Any) -> None:
        self.prompt = prompt
        self.completion = completion
        self.requests: dict[int, Any] = {}


class _GpuActivity(Protocol):
    """What `engine.nvml.GpuActivity` holds (a Protocol: this module is a leaf)."""

    @property
    def index(self) -> int: ...
    @property
    def name(self) -> str: ...
    @property
    def uuid(self) -> str: ...
    @property
    def utilization(self) -> float | None: ...
    @property
    def memory_used(self) -> int: ...
    @property
    def memory_total(self) -> int: ...
    @property
    def temperature(self) -> float | None: ...
    @property
    def power(self) -> float | None: ...
    @property
    def pcie_tx(self) -> float | None: ...
    @property
    def pcie_rx(self) -> float | None: ...


# name, help, attribute of the activity reading.
_GPU_GAUGES = (
    (
        "nemotron_gateway_gpu_utilization_ratio",
        "Fraction of the last sample period a kernel ran on the GPU.",
        "utilization",
    ),
    ("nemotron_gateway_gpu_memory_used_bytes", "GPU memory in use (every process).", "memory_used"),
    ("nemotron_gateway_gpu_memory_total_bytes", "GPU memory in all.", "memory_total"),
    ("nemotron_gateway_gpu_temperature_celsius", "GPU core temperature.", "temperature"),
    ("nemotron_gateway_gpu_power_watts", "GPU power draw.", "power"),
    ("nemotron_gateway_gpu_pcie_transmit_bytes_per_second", "PCIe throughput, device to host.", "pcie_tx"),
    ("nemotron_gateway_gpu_pcie_receive_bytes_per_second", "PCIe throughput, host to device.", "pcie_rx"),
)


class WorkersCollector(Collector):
    """Several workers: their metrics summed from the shared directory (`multiprocess`), without the series of
    keys this worker has seen revoked, and each living worker's `process_*` figures labelled with its pid (a
    worker's RSS or open files are its own; summing them is the dashboard's choice)."""

    def __init__(self, shared: Collector, forgotten: set[str], pids: Callable[[], Iterable[int]]) -> None:
        self._shared = shared
        self._forgotten = forgotten
        self._pids = pids

    def collect(self) -> Iterator[Metric]:
        for family in self._shared.collect():
            if self._forgotten:
                family.samples = [s for s in family.samples if s.labels.get("key") not in self._forgotten]
            yield family
        by_name: dict[str, Metric] = {}
        for pid in self._pids():
            for family in ProcessCollector(pid=functools.partial(str, pid), registry=None).collect():
                merged = by_name.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                merged.samples += [s._replace(labels={**s.labels, "pid": str(pid)}) for s in family.samples]
        yield from by_name.values()


class GpuCollector(Collector):
    """The machine's GPUs, read when Prometheus scrapes (the scrape runs off the event loop); no GPU, no
    series. Labelled gpu (index), name and uuid, as NVIDIA's DCGM exporter labels them."""

    def __init__(self, read: Callable[[], Sequence[_GpuActivity]]) -> None:
        self._read = read

    def collect(self) -> Iterator[GaugeMetricFamily]:
        gpus = self._read()
        if not gpus:
            return
        for name, documentation, attribute in _GPU_GAUGES:
            family = GaugeMetricFamily(name, documentation, labels=("gpu", "name", "uuid"))
            for gpu in gpus:
                value = getattr(gpu, attribute)
                if value is not None:
                    family.add_metric((str(gpu.index), gpu.name, gpu.uuid), float(value))
            yield family


class _HasValue(Protocol):
    @property
    def value(self) -> str: ...


class _RestartRecord(Protocol):
    @property
    def cause(self) -> _HasValue: ...


class _SupervisorStatus(Protocol):
    @property
    def state(self) -> _HasValue: ...
    @property
    def restarts(self) -> int: ...
    @property
    def last_exit_code(self) -> int | None: ...
    @property
    def since(self) -> float: ...
    @property
    def history(self) -> list[Any]: ...


SUPERVISOR_STATES = ("starting", "ready", "unhealthy", "restarting", "stopping", "stopped", "failed")
# RestartCause values (engine/supervisor_state.py), as label values.
EXIT_CAUSES = ("crash", "start_failed", "not_generating", "unresponsive", "requested")


class SupervisorMetrics:
    """The engine supervisor's metrics (its own process, its own registry and port), one series per managed replica
    (label `replica`: its index; `0` for a single engine).

    Named `nemotron_supervisor_*`: the gateway's `nemotron_gateway_engine_up` is its own probe's view, this is
    the supervisor's, and one Prometheus scrapes both."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self.state = Gauge(
            "nemotron_supervisor_engine_state",
            "1 for the supervisor's current engine state, 0 for the others.",
            ["replica", "state"],
            registry=r,
        )
        self.up = Gauge(
            "nemotron_supervisor_engine_up", "1 while the engine is ready, else 0.", ["replica"], registry=r
        )
        self.restarts = Counter(
            "nemotron_supervisor_engine_restarts",
            "Engine restarts since the supervisor started.",
            ["replica"],
            registry=r,
        )
        self.last_exit_code = Gauge(
            "nemotron_supervisor_engine_last_exit_code",
            "Exit code of the engine's last exit (-N: signal N).",
            ["replica"],
            registry=r,
        )
        self.last_exit = Gauge(
            "nemotron_supervisor_engine_last_exit",
            "1 for the cause of the engine's last end without a stop asked for (crash, start_failed, not_generating, "
            "unresponsive, requested).",
            ["replica", "cause"],
            registry=r,
        )
        self.startup_duration = Gauge(
            "nemotron_supervisor_engine_startup_duration_seconds",
            "Seconds the engine's last start took, from spawn to ready.",
            ["replica"],
            registry=r,
        )
        # Per replica: restarts already counted, and since when its engine has been starting.
        self._restarts_seen: dict[str, int] = {}
        self._starting_since: dict[str, float] = {}

    def observe(self, status: _SupervisorStatus, replica: str = "0") -> None:
        """Export a status snapshot of replica `replica`."""
        current = status.state.value
        for state in SUPERVISOR_STATES:
            self.state.labels(replica, state).set(1 if state == current else 0)
        self.up.labels(replica).set(1 if current == "ready" else 0)
        # A labelled counter has no series until touched: a replica that never restarted still shows its 0.
        restarts = self.restarts.labels(replica)
        seen = self._restarts_seen.get(replica, 0)
        if status.restarts > seen:
            restarts.inc(status.restarts - seen)
            self._restarts_seen[replica] = status.restarts
        if status.last_exit_code is not None:
            self.last_exit_code.labels(replica).set(status.last_exit_code)
        if status.history:
            last = status.history[-1].cause.value.replace(" ", "_")
            for cause in EXIT_CAUSES:
                self.last_exit.labels(replica, cause).set(1 if cause == last else 0)
        starting_since = self._starting_since.get(replica)
        if current == "starting" and starting_since is None:
            self._starting_since[replica] = status.since
        elif current == "ready" and starting_since is not None:
            self.startup_duration.labels(replica).set(status.since - starting_since)
            del self._starting_since[replica]
        elif current != "starting":
            self._starting_since.pop(replica, None)
