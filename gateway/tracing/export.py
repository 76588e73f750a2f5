"""SpanBatcher: finished spans go to the OTLP exporter in batches, from a thread of their own, and a request never
waits for them.

A request's spans are queued whole or not at all: when the bounded queue (`OTEL_BSP_MAX_QUEUE_SIZE`) has no room
they are dropped and counted (`nemotron_gateway_trace_spans_dropped_total{reason="queue_full"}`), as are the spans of
a batch the collector refused or never answered (`export_failed`) and those still queued when the gateway stops
(`shutdown`). So a collector that is down, slow or refusing costs a request an append to a deque; the export thread
waits on the network without the interpreter's lock. One batcher per worker process, started in its lifespan (a
thread does not survive a fork). Imports the metric instruments and the OTLP settings only.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from gateway.metrics.instruments import GatewayMetrics
from gateway.tracing.otlp import OtlpTraces

logger = logging.getLogger(__name__)

# The SDK's OTLP/HTTP exporter logs every retry and every failed batch: with a collector down, a line or two a second
# per worker. Its lines still tell why (a refused connection, a 401 for wrong headers), one a minute.
EXPORTER_LOGGER = "opentelemetry.exporter.otlp.proto.http.trace_exporter"
EXPORTER_LOG_INTERVAL = 60.0


class LogThrottle(logging.Filter):
    """Lets one record through every `interval` seconds."""

    def __init__(self, interval: float, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self._interval = interval
        self._clock = clock
        self._next = float("-inf")

    def filter(self, record: logging.LogRecord) -> bool:
        now = self._clock()
        if now < self._next:
            return False
        self._next = now + self._interval
        return True


class SpanBatcher:
    """A bounded queue of finished spans and the thread that exports them (see the module docstring)."""

    def __init__(self, exporter: SpanExporter, otlp: OtlpTraces, metrics: GatewayMetrics) -> None:
        self._exporter = exporter
        self._max_queue = otlp.max_queue_size
        self._batch = otlp.max_export_batch_size
        self._delay = otlp.schedule_delay
        self._queue: collections.deque[ReadableSpan] = collections.deque()
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._exported = metrics.trace_spans_exported
        self._dropped = {
            reason: metrics.trace_spans_dropped.labels(reason) for reason in ("queue_full", "export_failed", "shutdown")
        }
        # One warning per outage: the next success logs that export works again.
        self._failing = False
        self._throttle = LogThrottle(EXPORTER_LOG_INTERVAL)

    def start(self) -> None:
        """Start the export thread (and quiet the exporter's own log to a line a minute)."""
        logging.getLogger(EXPORTER_LOGGER).addFilter(self._throttle)
        self._thread = threading.Thread(target=self._run, name="nemotron-span-export", daemon=True)
        self._thread.start()

    def add(self, spans: Sequence[ReadableSpan]) -> None:
        """Queue one request's spans (on the event loop; never blocks): all of them, or none when the queue is full."""
        queue = self._queue
        if self._stopping or len(queue) + len(spans) > self._max_queue:
            self._dropped["shutdown" if self._stopping else "queue_full"].inc(len(spans))
            return
        queue.extend(spans)
        if len(queue) >= self._batch and not self._wake.is_set():
            self._wake.set()

    def stop(self, timeout: float) -> None:
        """Export what is queued within `timeout` seconds, then stop the exporter (it abandons a retry in progress);
        spans left are counted as dropped. Blocking: call it off the event loop."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._exporter.shutdown()
        if self._thread is not None:
            # Anything still queued never went out: the thread is gone, or stuck in a send that will fail.
            self._thread.join(0.1)
        left = len(self._queue)
        self._queue.clear()
        if left:
            self._dropped["shutdown"].inc(left)
        logging.getLogger(EXPORTER_LOGGER).removeFilter(self._throttle)

    def _run(self) -> None:
        while not self._stopping:
            self._wake.wait(self._delay)
            self._wake.clear()
            self._drain(whole=False)
        self._drain(whole=True)

    def _drain(self, *, whole: bool) -> None:
        """Export full batches (and once a partial one: the schedule delay is over); `whole`: everything."""
        queue = self._queue
        first = True
        while queue and (whole or first or len(queue) >= self._batch):
            first = False
            batch = [queue.popleft() for _ in range(min(self._batch, len(queue)))]
            self._export(batch)

    def _export(self, batch: list[ReadableSpan]) -> None:
        try:
            result = self._exporter.export(batch)
        except Exception:  # an exporter bug must not end the thread: the batch is lost, counted, logged once
            logger.exception("exporting %d spans failed", len(batch))
            result = SpanExportResult.FAILURE
        if result is SpanExportResult.SUCCESS:
            self._exported.inc(len(batch))
            if self._failing:
                self._failing = False
                logger.warning("the trace collector takes spans again")
            return
        self._dropped["export_failed"].inc(len(batch))
        if not self._failing:
            self._failing = True
            logger.warning(
                "the trace collector did not take %d spans; they are dropped and counted in "
                "nemotron_gateway_trace_spans_dropped_total until it does",
                len(batch),
            )
