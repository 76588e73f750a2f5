"""A real OTLP/HTTP trace receiver for the tests: it decodes `ExportTraceServiceRequest` protobufs (gzip or plain) as a
collector does, with the OpenTelemetry protocol's own generated classes, and keeps every span it is sent.

Bound to 127.0.0.1 on a free port, served by a thread of the test process; `Receiver.spans()` reads what arrived
and `wait_for` waits (bounded) for what a test expects. `refuse` answers every export with an HTTP status instead
(a collector that refuses), `hold` accepts the connection and answers nothing (a blackholed collector).
"""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

TRACES_PATH = "/v1/traces"
_KINDS = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(entry) for entry in value.array_value.values]
    if kind == "kvlist_value":
        return _attributes(value.kvlist_value.values)
    return getattr(value, kind) if kind is not None else None


def _attributes(pairs: Any) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs if isinstance(pair, KeyValue)}


@dataclass(frozen=True)
class Event:
    name: str
    time_ns: int
    attributes: dict[str, Any]


@dataclass(frozen=True)
class Span:
    """One received span, its ids in lowercase hex as `traceparent` writes them."""

    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    kind: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: tuple[Event, ...]
    service: str
    resource: dict[str, Any]
    status_code: int
    status_message: str

    def event(self, name: str) -> Event | None:
        """The first event called `name`, or None."""
        return next((event for event in self.events if event.name == name), None)


@dataclass
class Receiver:
    url: str  # the OTLP base endpoint (OTEL_EXPORTER_OTLP_ENDPOINT); traces go to url + /v1/traces
    _spans: list[Span] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    requests: int = 0
    refuse: int | None = None
    hold: threading.Event | None = None

    @property
    def traces_url(self) -> str:
        return self.url + TRACES_PATH

    def take(self, body: bytes) -> None:
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        found = []
        for resource_spans in request.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    found.append(
                        Span(
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            name=span.name,
                            kind=_KINDS.get(span.kind, str(span.kind)),
                            start_ns=span.start_time_unix_nano,
                            end_ns=span.end_time_unix_nano,
                            attributes=_attributes(span.attributes),
                            events=tuple(
                                Event(event.name, event.time_unix_nano, _attributes(event.attributes))
                                for event in span.events
                            ),
                            service=str(resource.get("service.name", "")),
                            resource=resource,
                            status_code=span.status.code,
                            status_message=span.status.message,
                        )
                    )
        with self._lock:
            self._spans.extend(found)

    def spans(self, trace_id: str | None = None) -> list[Span]:
        """Every span received so far (of `trace_id` only, when given)."""
        with self._lock:
            return [span for span in self._spans if trace_id is None or span.trace_id == trace_id]

    def wait_for(
        self, found: Callable[[list[Span]], bool], *, timeout: float, trace_id: str | None = None
    ) -> list[Span]:
        """The spans (of `trace_id`) once `found(spans)` holds; AssertionError with what arrived after `timeout`
        seconds (a guard against a hung test, not a latency bound)."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.spans(trace_id)
            if found(spans):
                return spans
            if time.monotonic() > deadline:
                names = sorted(f"{span.service}:{span.name}" for span in spans)
                raise AssertionError(f"the receiver did not get the spans expected within {timeout:g} s: {names}")
            time.sleep(0.05)


def _handler(receiver: Receiver) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            with receiver._lock:
                receiver.requests += 1
            if receiver.hold is not None:
                receiver.hold.wait(60)  # a blackhole: the connection is open, no answer comes
                return
            if receiver.refuse is not None:
                self._answer(receiver.refuse, b"refused")
                return
            if self.path != TRACES_PATH:
                self._answer(404, b"")
                return
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            receiver.take(body)
            self._answer(200, ExportTraceServiceResponse().SerializeToString(), "application/x-protobuf")

        def _answer(self, status: int, body: bytes, content_type: str = "text/plain") -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


@contextmanager
def running_receiver() -> Iterator[Receiver]:
    """A receiver on 127.0.0.1 and a free port, stopped (its threads joined) on exit."""
    receiver = Receiver(url="")
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(receiver))
    server.daemon_threads = True
    receiver.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, name="otlp-receiver", daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        if receiver.hold is not None:
            receiver.hold.set()
        server.shutdown()
        server.server_close()
        thread.join(10)
