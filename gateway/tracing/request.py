"""RequestTrace: one relayed request's trace, from its ids at the start to its spans at its end.

The trace's ids exist from the request's start, so the engine request carries the `traceparent` of the gateway's
engine span (vLLM's own span nests under it). Everything else is built once the answer's last byte is sent, from the
marks the route, the relay and the middleware left on the `RequestRecord` (key checked, prepared, engine connected,
answered, settled, first chunk, client gone) and from what the engine's answer said (`read`): the hot path pays a
few clock reads and attribute writes, and an unsampled request none of the span work.

The spans, children of the client's `traceparent` when it sent one:

    SERVER  "{gen_ai.operation.name} {gen_ai.request.model}"   the request, GenAI attributes, events
      INTERNAL "key check"                                     the API key looked up
      INTERNAL "admission"                                     the key's limits and the engine queue's admission
      CLIENT   "POST {engine path}"                            the exchange with the engine (vLLM's span under it)

The spans are built as the SDK's `ReadableSpan`s directly (a tenth of what its live spans cost per request); what
that relies on beyond the SDK's documented API is declared in `INTERNALS` and checked against the installed SDK by
tests/unit/test_library_internals.py. Never a key, a header or (unless captured on purpose) a prompt in them.
Imports the request record, the OTLP settings and the content capture.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import urlsplit

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

from gateway.request_record import RequestRecord
from gateway.tracing.content import OutputText, input_attributes
from gateway.types import LibraryInternals

logger = logging.getLogger(__name__)

# The SDK's span class, built here directly rather than through a tracer (the SDK's docstring says it is meant to
# come from its pipeline): the keyword arguments passed are checked against the installed SDK.
INTERNALS: Final = (
    LibraryInternals(
        ReadableSpan,
        called=(
            (
                "__init__",
                (
                    *("name", "context", "parent", "resource", "attributes", "events", "kind", "status"),
                    *("start_time", "end_time", "instrumentation_scope"),
                ),
            ),
        ),
    ),
)
# The OpenTelemetry SDK releases the above was checked on: the bound in pyproject.toml, word for word.
REQUIREMENT: Final = "opentelemetry-sdk>=1.45,<2"

SAMPLED = TraceFlags(TraceFlags.SAMPLED)
NOT_SAMPLED = TraceFlags(TraceFlags.DEFAULT)
# The GenAI conventions' operation and provider (the API flavour the client speaks) for each relayed API.
_OPERATIONS = {
    "chat": ("chat", "openai"),
    "completions": ("text_completion", "openai"),
    "responses": ("chat", "openai"),
    "messages": ("chat", "anthropic"),
}
# What makes the stream relay parse a chunk for the trace: a chat or completion choice's finish reason (the Responses
# and Messages streams carry theirs in events the relay parses anyway), or every data line when text is captured.
FINISH_MARKS: Final = (b'"finish_reason":"',)
CONTENT_MARKS: Final = (b"data:",)


def engine_address(url: str) -> tuple[str, int]:
    """An engine URL's host and port, as the engine span's `server.address` and `server.port` name them."""
    parts = urlsplit(url)
    return parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)


@dataclass(frozen=True, slots=True)
class Destination:
    """Where a request's spans go and what they share: the process's resource and scope, the engine's address, the
    capture switch, `export` (the batcher's queue) and the source of span ids."""

    resource: Resource
    scope: InstrumentationScope
    engine_host: str
    engine_port: int
    capture_content: bool
    export: Callable[[Sequence[ReadableSpan]], None]
    new_span_id: Callable[[], int]


class RequestTrace:
    """One request's trace (see the module docstring); `recording` False: only its `traceparent` travels on."""

    __slots__ = (
        "_destination",
        "_finish_reasons",
        "_generates",
        "_input",
        "_max_tokens",
        "_output",
        "_perf_anchor",
        "_response_id",
        "_response_model",
        "_sent_at",
        "_wall_anchor",
        "engine_span_id",
        "marks",
        "parent",
        "recording",
        "span_id",
        "trace_id",
        "trace_state",
    )

    def __init__(
        self,
        destination: Destination,
        trace_id: int,
        span_id: int,
        engine_span_id: int,
        parent: SpanContext | None,
        trace_state: TraceState | None,
        *,
        recording: bool,
        anchors: tuple[int, float] = (0, 0.0),
    ) -> None:
        self._destination = destination
        self.trace_id = trace_id
        self.span_id = span_id
        self.engine_span_id = engine_span_id
        self.parent = parent
        self.trace_state = trace_state
        self.recording = recording
        # The wall clock (ns since the epoch) and the record's clock (perf_counter) read together at the start: every
        # mark of the record is placed on the wall clock from them.
        self._wall_anchor, self._perf_anchor = anchors
        self._sent_at: float | None = None
        self._max_tokens: int | None = None
        self._generates = True
        self._finish_reasons: list[str] = []
        self._response_id: str | None = None
        self._response_model: str | None = None
        self._input: bytes | None = None
        self._output = OutputText() if recording and destination.capture_content else None
        if not recording:
            self.marks: tuple[bytes, ...] = ()
        else:
            self.marks = CONTENT_MARKS if destination.capture_content else FINISH_MARKS

    @property
    def traceparent(self) -> str:
        """The W3C `traceparent` of the engine span: what the engine request carries."""
        flags = "01" if self.recording else "00"
        return f"00-{self.trace_id:032x}-{self.engine_span_id:016x}-{flags}"

    def sending(
        self,
        headers: MutableMapping[str, str],
        sent_at: float,
        max_tokens: int | None,
        body: bytes,
        *,
        generates: bool = True,
    ) -> None:
        """The engine request is about to go out at `sent_at` (admitted): its headers get the trace context. One that
        `generates` nothing (Anthropic's token count) is no GenAI operation."""
        headers["traceparent"] = self.traceparent
        if self.trace_state:
            headers["tracestate"] = self.trace_state.to_header()
        self._sent_at = sent_at
        self._max_tokens = max_tokens
        self._generates = generates
        if self._output is not None:
            self._input = body

    def read(self, event: dict[str, Any]) -> None:
        """Take what an engine answer or stream event says: finish reasons, the answer's id and model, its text
        (captured only)."""
        if not self.recording:
            return
        _finish_reasons(event, self._finish_reasons)
        inner = _inner(event)
        if self._response_id is None and isinstance(inner.get("id"), str):
            self._response_id = inner["id"]
        if self._response_model is None and isinstance(inner.get("model"), str):
            self._response_model = inner["model"]
        if self._output is not None:
            self._output.read(event)

    def end(self, record: RequestRecord, status: int, ended_at: float) -> None:
        """Build the request's spans and queue them for export (nothing when not recording). Never raises: a trace
        that cannot be built is logged and left out."""
        if not self.recording:
            return
        try:
            spans = self.spans(record, status, ended_at)
        except Exception:
            logger.exception("the trace of request %s could not be built", record.request_id)
            return
        self._destination.export(spans)

    def _ns(self, at: float) -> int:
        return self._wall_anchor + round((at - self._perf_anchor) * 1e9)

    def _context(self, span_id: int) -> SpanContext:
        return SpanContext(self.trace_id, span_id, False, SAMPLED, self.trace_state)

    def spans(self, record: RequestRecord, status: int, ended_at: float) -> list[ReadableSpan]:
        """The request's spans (see the module docstring), its server span first."""
        destination = self._destination
        server = self._context(self.span_id)
        start, end = self._ns(record.started_at), self._ns(ended_at)
        attributes = self._server_attributes(record, status)
        marks = (("first_chunk_sent", record.first_chunk_at), ("client_disconnected", record.client_gone_at))
        events = [Event(name, timestamp=self._ns(at)) for name, at in marks if at is not None]
        operation = attributes.get("gen_ai.operation.name")
        name = f"{operation} {record.model}" if operation and record.model else operation or f"POST {record.route}"
        error = _error_type(record, status)
        spans = [
            ReadableSpan(
                name=name,
                context=server,
                parent=self.parent,
                resource=destination.resource,
                attributes=attributes,
                events=events,
                kind=SpanKind.SERVER,
                status=Status(StatusCode.ERROR, error) if status >= 500 else Status(StatusCode.UNSET),
                start_time=start,
                end_time=end,
                instrumentation_scope=destination.scope,
            )
        ]
        # The key check runs first: it ended when the key was known, or with the request when it refused it.
        checked = record.key_checked_at
        spans.append(self._child(server, "key check", start, checked or ended_at, {}, None if checked else error))
        if record.prepared_at is not None:
            admitted = self._sent_at or ended_at
            refusal = None if self._sent_at is not None else error
            priority = {"nemotron.priority": record.priority} if record.priority is not None else {}
            spans.append(self._child(server, "admission", self._ns(record.prepared_at), admitted, priority, refusal))
        if self._sent_at is not None:
            spans.append(self._engine_span(server, record, ended_at))
        return spans

    def _child(
        self,
        parent: SpanContext,
        name: str,
        start_ns: int,
        ended_at: float,
        attributes: Mapping[str, Any],
        error: str | None,
    ) -> ReadableSpan:
        destination = self._destination
        if error is not None:
            attributes = {**attributes, "error.type": error}
        return ReadableSpan(
            name=name,
            context=self._context(destination.new_span_id()),
            parent=parent,
            resource=destination.resource,
            attributes=attributes,
            kind=SpanKind.INTERNAL,
            status=Status(StatusCode.ERROR, error) if error is not None else Status(StatusCode.UNSET),
            start_time=start_ns,
            end_time=self._ns(ended_at),
            instrumentation_scope=destination.scope,
        )

    def _engine_span(self, server: SpanContext, record: RequestRecord, ended_at: float) -> ReadableSpan:
        destination = self._destination
        assert self._sent_at is not None
        ended = record.engine_ended_at or ended_at
        marks = [("connected", record.engine_connected_at), ("first_byte", record.engine_answered_at)]
        if record.engine_error is None and record.engine_ended_at is not None:
            marks.append(("last_byte", record.engine_ended_at))
        host, port = (
            (destination.engine_host, destination.engine_port)
            if record.replica is None
            else engine_address(record.replica)
        )
        attributes: dict[str, Any] = {"http.request.method": "POST", "server.address": host, "server.port": port}
        if record.replica is not None:  # the replica that answered (the last one tried, after a failover)
            attributes["nemotron.replica"] = record.replica
        if record.engine_request_id is not None:
            attributes["nemotron.engine_request_id"] = record.engine_request_id
        kind = record.engine_error
        if kind is not None:
            attributes["error.type"] = str(kind)
        return ReadableSpan(
            name=f"POST {record.route}" if record.route else "POST",
            context=self._context(self.engine_span_id),
            parent=server,
            resource=destination.resource,
            attributes=attributes,
            events=[Event(name, timestamp=self._ns(at)) for name, at in marks if at is not None],
            kind=SpanKind.CLIENT,
            status=Status(StatusCode.ERROR, str(kind)) if kind is not None else Status(StatusCode.UNSET),
            start_time=self._ns(self._sent_at),
            end_time=self._ns(ended),
            instrumentation_scope=destination.scope,
        )

    def _server_attributes(self, record: RequestRecord, status: int) -> dict[str, Any]:
        attributes: dict[str, Any] = {
            "http.request.method": "POST",
            "http.response.status_code": status,
            "nemotron.request_id": record.request_id,
            "nemotron.stream": record.stream,
        }
        if record.route is not None:
            attributes["http.route"] = record.route
        operation = _OPERATIONS.get(record.api or "") if self._generates else None
        if operation is not None:
            attributes["gen_ai.operation.name"], attributes["gen_ai.provider.name"] = operation
        if record.api is not None:
            attributes["nemotron.api"] = record.api
        optional = (
            ("gen_ai.request.model", record.model),
            ("gen_ai.request.max_tokens", self._max_tokens),
            ("gen_ai.usage.input_tokens", record.prompt_tokens),
            ("gen_ai.usage.output_tokens", record.completion_tokens),
            ("gen_ai.response.id", self._response_id),
            ("gen_ai.response.model", self._response_model),
            ("nemotron.usage.reasoning_tokens", record.reasoning_tokens),
            ("nemotron.key.name", record.key_name),
            ("nemotron.priority", record.priority),
            ("nemotron.engine_error", str(record.engine_error) if record.engine_error else None),
            ("nemotron.cause", record.cause),
        )
        attributes.update((name, value) for name, value in optional if value is not None)
        if self._finish_reasons:
            attributes["gen_ai.response.finish_reasons"] = tuple(self._finish_reasons)
        if record.client_disconnected:
            attributes["nemotron.client_disconnected"] = True
        error = _error_type(record, status)
        if error is not None:
            attributes["error.type"] = error
        if self._input is not None:
            attributes.update(input_attributes(self._input))
        if self._output is not None and self._sent_at is not None:
            attributes["gen_ai.output.messages"] = self._output.attribute(self._finish_reasons)
        return attributes


def _inner(event: dict[str, Any]) -> dict[str, Any]:
    """The answer an event is about: a Responses event's `response`, a Messages `message_start`'s `message`, else the
    event itself."""
    for field in ("response", "message"):
        inner = event.get(field)
        if isinstance(inner, dict):
            return inner
    return event


def _error_type(record: RequestRecord, status: int) -> str | None:
    """The conventions' `error.type` of a failed request: the engine failure's kind, the refusal's cause, else the
    status; None for a success."""
    if record.engine_error is not None:
        return str(record.engine_error)
    if status < 400:
        return None
    return record.cause or str(status)


def _finish_reasons(event: dict[str, Any], found: list[str]) -> None:
    """Append the finish reasons `event` reports: its choices' (chat, completions), a finished Responses answer's
    status or why it is incomplete, a Messages answer's stop reason."""
    choices = event.get("choices")
    if isinstance(choices, list):
        for choice in choices:
            if isinstance(choice, dict) and isinstance(choice.get("finish_reason"), str):
                found.append(choice["finish_reason"])
        return
    response = _inner(event)
    if response.get("object") == "response" and response.get("status") in ("completed", "incomplete", "failed"):
        details = response.get("incomplete_details")
        reason = details.get("reason") if isinstance(details, dict) else None
        found.append(str(reason or response["status"]))
        return
    holder = event.get("delta") if event.get("type") == "message_delta" else event
    if isinstance(holder, dict) and isinstance(holder.get("stop_reason"), str):
        found.append(holder["stop_reason"])
