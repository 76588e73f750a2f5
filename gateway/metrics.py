"""Every Prometheus object the gateway exports, built into one registry per app.

A leaf: imports no other gateway module. Names are `nemotron_gateway_<noun>_<unit>`; never the
engine's `vllm:` prefix, never a secret as a label.
"""

from __future__ import annotations

from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Latency buckets from 5 ms to 10 min: a non-streamed completion may legitimately take minutes.
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60)


class GatewayMetrics:
    """The gateway's metrics in their own registry (several apps may live in one process in tests)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
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
        self.in_flight = Gauge(
            "nemotron_gateway_requests_in_flight",
            "Requests being served right now.",
            registry=r,
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
            "mid_stream, frozen).",
            ["kind"],
            registry=r,
        )
        self.engine_up = Gauge(
            "nemotron_gateway_engine_up",
            "1 when the gateway's last probe of the engine's /health succeeded, else 0.",
            registry=r,
        )
        self.redis_up = Gauge(
            "nemotron_gateway_redis_up",
            "1 when the last Redis ping succeeded, else 0.",
            registry=r,
        )


class _SupervisorStatus(Protocol):
    @property
    def state(self) -> _HasValue: ...
    @property
    def restarts(self) -> int: ...
    @property
    def last_exit_code(self) -> int | None: ...


class _HasValue(Protocol):
    @property
    def value(self) -> str: ...


SUPERVISOR_STATES = ("starting", "ready", "unhealthy", "restarting", "stopping", "stopped", "failed")


class SupervisorMetrics:
    """The engine supervisor's metrics (its own process, its own registry and port)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self.state = Gauge(
            "nemotron_gateway_engine_state",
            "1 for the supervisor's current engine state, 0 for the others.",
            ["state"],
            registry=r,
        )
        self.up = Gauge("nemotron_gateway_engine_up", "1 while the engine is ready, else 0.", registry=r)
        self.restarts = Gauge(
            "nemotron_gateway_engine_restarts", "Engine restarts since the supervisor started.", registry=r
        )
        self.last_exit_code = Gauge(
            "nemotron_gateway_engine_last_exit_code", "Exit code of the engine's last exit (-N: signal N).", registry=r
        )

    def observe(self, status: _SupervisorStatus) -> None:
        """Export a status snapshot."""
        current = status.state.value
        for state in SUPERVISOR_STATES:
            self.state.labels(state).set(1 if state == current else 0)
        self.up.set(1 if current == "ready" else 0)
        self.restarts.set(status.restarts)
        if status.last_exit_code is not None:
            self.last_exit_code.set(status.last_exit_code)
