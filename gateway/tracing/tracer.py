"""Tracer: the gateway's OpenTelemetry tracing in one worker process, where the OTEL_* variables turn it on.

It begins each relayed request's trace (`begin`: the client's `traceparent` continued when it sent a valid one, the
sampler's decision, the ids), and owns what its spans share and where they go (the OTLP/HTTP exporter behind a
`SpanBatcher`). Tracing off: no Tracer, no SDK object, nothing on the request path. Built in the lifespan (its
export thread must start in the worker, after any fork). Imports settings, the metric instruments and its package.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping

from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace.export import SpanExporter
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    Decision,
    ParentBased,
    Sampler,
    TraceIdRatioBased,
)
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import get_current_span
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from gateway import __version__
from gateway.metrics.instruments import GatewayMetrics
from gateway.settings import Settings, TracingSettings, otel_variables
from gateway.tracing.export import SpanBatcher
from gateway.tracing.otlp import OtlpTraces
from gateway.tracing.request import Destination, RequestTrace, engine_address

# What the sampler sees for a request without a parent: an empty context (never the process's current one).
_NO_PARENT = Context()
# The longest a stopping gateway waits for its last spans to go out.
STOP_TIMEOUT = 5.0


def sampler_of(otlp: OtlpTraces) -> Sampler:
    """The SDK sampler that OTEL_TRACES_SAMPLER (and its ratio, OTEL_TRACES_SAMPLER_ARG) names."""
    root: Sampler = TraceIdRatioBased(otlp.ratio) if otlp.sampler.endswith("traceidratio") else ALWAYS_ON
    if otlp.sampler.endswith("always_off"):
        root = ALWAYS_OFF
    return ParentBased(root) if otlp.sampler.startswith("parentbased_") else root


class Tracer:
    """Begins request traces and exports their spans (see the module docstring)."""

    def __init__(
        self,
        otlp: OtlpTraces,
        settings: TracingSettings,
        engine_url: str,
        metrics: GatewayMetrics,
        *,
        exporter: SpanExporter | None = None,
        clock: Callable[[], float] = time.perf_counter,
        wall: Callable[[], int] = time.time_ns,
    ) -> None:
        assert otlp.endpoint is not None, "a Tracer is made only where tracing is on"
        self._sampler = sampler_of(otlp)
        self._propagator = TraceContextTextMapPropagator()
        self._ids = RandomIdGenerator()
        self._batcher = SpanBatcher(exporter or OTLPSpanExporter(endpoint=otlp.endpoint), otlp, metrics)
        self._clock, self._wall = clock, wall
        self._stop_timeout = min(otlp.export_timeout, STOP_TIMEOUT)
        engine_host, engine_port = engine_address(engine_url)
        self._destination = Destination(
            resource=Resource.create({"service.name": otlp.service_name, "service.version": __version__}),
            scope=InstrumentationScope("nemotron-gateway", __version__),
            engine_host=engine_host,
            engine_port=engine_port,
            capture_content=settings.capture_content,
            export=self._batcher.add,
            new_span_id=self._ids.generate_span_id,
        )

    @classmethod
    def from_settings(cls, settings: Settings, metrics: GatewayMetrics) -> Tracer | None:
        """The process's tracer where the OTEL_* variables name a collector, else None (tracing off)."""
        otlp = OtlpTraces.from_variables(otel_variables())
        return cls(otlp, settings.tracing, settings.engine_url, metrics) if otlp.enabled else None

    async def start(self) -> None:
        """Start the export thread."""
        self._batcher.start()

    async def stop(self) -> None:
        """Export what is queued (a few seconds at most), then stop."""
        await asyncio.to_thread(self._batcher.stop, self._stop_timeout)

    def begin(self, headers: Mapping[str, str]) -> RequestTrace:
        """A relayed request's trace, from its headers: the client's `traceparent` (and `tracestate`) continued when
        valid, else a new trace; sampled as OTEL_TRACES_SAMPLER says (a parent-based sampler follows the client's
        flag)."""
        ids = self._ids
        parent = None
        context = _NO_PARENT
        header = headers.get("traceparent")
        if header is not None:
            carrier = {"traceparent": header}
            state = headers.get("tracestate")
            if state is not None:
                carrier["tracestate"] = state
            context = self._propagator.extract(carrier)
            found = get_current_span(context).get_span_context()
            if found.is_valid:
                parent = found
        trace_id = parent.trace_id if parent is not None else ids.generate_trace_id()
        decision = self._sampler.should_sample(context, trace_id, "request")
        recording = decision.decision is Decision.RECORD_AND_SAMPLE
        return RequestTrace(
            self._destination,
            trace_id,
            ids.generate_span_id(),
            ids.generate_span_id(),
            parent,
            decision.trace_state,
            recording=recording,
            anchors=(self._wall(), self._clock()) if recording else (0, 0.0),
        )
