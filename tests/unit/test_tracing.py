"""Tracing without sockets: what the OTEL_* variables turn on, a request's trace continued from the client's
`traceparent` and sampled, its spans built from the record's marks on injected clocks and decoded as a collector
decodes them, the export queue's bounds and counts, the text that never goes out unless captured, and vLLM's flags."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import SpanContext, TraceFlags

from gateway import cli
from gateway.engine.tracing import ENDPOINT_FLAG, with_tracing
from gateway.http.middleware import RequestContextMiddleware
from gateway.metrics.instruments import GatewayMetrics
from gateway.request_record import EngineErrorKind, RequestRecord
from gateway.settings import HttpSettings, Settings, TracingSettings
from gateway.tracing.content import OutputText, input_attributes
from gateway.tracing.export import LogThrottle, SpanBatcher
from gateway.tracing.otlp import OtlpConfigError, OtlpTraces
from gateway.tracing.request import RequestTrace
from gateway.tracing.tracer import Tracer
from gateway.types import Message, Send
from tests.otlp import Receiver, Span

pytestmark = pytest.mark.timeout(10)

ENDPOINT = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector.example:4318"}
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
SECRET = "sk-nemotron-0123456789abcdef-secret"
WALL_START = 1_700_000_000_000_000_000  # ns since the epoch when the record's clock read 100.0


class Collected(SpanExporter):
    """An exporter that keeps what it is given (or refuses it)."""

    def __init__(self, result: SpanExportResult = SpanExportResult.SUCCESS) -> None:
        self.result = result
        self.batches: list[list[ReadableSpan]] = []
        self.shut = threading.Event()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.batches.append(list(spans))
        return self.result

    def shutdown(self) -> None:
        self.shut.set()


def otlp(**variables: str) -> OtlpTraces:
    return OtlpTraces.from_variables({**ENDPOINT, **variables})


def tracer(metrics: GatewayMetrics | None = None, *, capture: bool = False, **variables: str) -> Tracer:
    return Tracer(
        otlp(**variables),
        TracingSettings(capture_content=capture),
        "http://127.0.0.1:8001",
        metrics or GatewayMetrics(),
        exporter=Collected(),
        clock=lambda: 100.0,
        wall=lambda: WALL_START,
    )


def decoded(spans: list[ReadableSpan]) -> list[Span]:
    """The spans as a collector receives them: OTLP protobuf, encoded by the SDK's encoder, decoded by the proto."""
    receiver = Receiver(url="")
    receiver.take(encode_spans(spans).SerializeToString())
    return receiver.spans()


def ms(at_ms: float) -> float:
    """A mark on the record's clock, `at_ms` milliseconds after the request started (at 100.0)."""
    return 100.0 + at_ms / 1000


def finished_record(**overrides: Any) -> RequestRecord:
    record = RequestRecord(
        request_id="req-1",
        started_at=ms(0),
        key_name="team-a",
        model="nemotron",
        stream=True,
        api="chat",
        route="/v1/chat/completions",
        prompt_tokens=12,
        completion_tokens=5,
        priority=2,
        engine_request_id="req-1-abcd",
        key_checked_at=ms(1),
        prepared_at=ms(2),
        engine_connected_at=ms(4),
        engine_answered_at=ms(10),
        first_chunk_at=ms(11),
        engine_ended_at=ms(40),
    )
    for name, value in overrides.items():
        setattr(record, name, value)
    return record


def sent(trace: RequestTrace, at_ms: float = 3, body: bytes = b"{}") -> dict[str, str]:
    headers: dict[str, str] = {"Authorization": f"Bearer {SECRET}"}
    trace.sending(headers, ms(at_ms), 64, body)
    return headers


# --- what turns tracing on ---


def test_tracing_is_off_without_a_collector_and_when_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not OtlpTraces.from_variables({}).enabled
    assert not OtlpTraces.from_variables({**ENDPOINT, "OTEL_SDK_DISABLED": "true"}).enabled
    assert not OtlpTraces.from_variables({**ENDPOINT, "OTEL_TRACES_EXPORTER": "none"}).enabled
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    assert Tracer.from_settings(Settings(), GatewayMetrics()) is None  # no tracer: nothing on the request path
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    assert isinstance(Tracer.from_settings(Settings(), GatewayMetrics()), Tracer)


def test_the_endpoint_follows_the_specification() -> None:
    assert otlp().endpoint == "http://collector.example:4318/v1/traces"
    signal = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "https://c.example/custom"}
    assert OtlpTraces.from_variables({**ENDPOINT, **signal}).endpoint == "https://c.example/custom"
    found = otlp(OTEL_SERVICE_NAME="edge", OTEL_BSP_SCHEDULE_DELAY="250", OTEL_BSP_MAX_QUEUE_SIZE="64")
    assert (found.service_name, found.schedule_delay, found.max_queue_size) == ("edge", 0.25, 64)


@pytest.mark.parametrize(
    ("variables", "named"),
    [
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "grpc"),
        ({"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"}, "http/json"),
        ({"OTEL_TRACES_SAMPLER": "jaeger_remote"}, "jaeger_remote"),
        ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "2"}, "OTEL_TRACES_SAMPLER_ARG"),
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "zipkin"),
        ({"OTEL_BSP_MAX_QUEUE_SIZE": "10", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "20"}, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE"),
        ({"OTEL_BSP_SCHEDULE_DELAY": "soon"}, "OTEL_BSP_SCHEDULE_DELAY"),
    ],
)
def test_what_the_gateway_cannot_follow_fails_at_start_naming_it(variables: dict[str, str], named: str) -> None:
    with pytest.raises(OtlpConfigError, match=named):
        otlp(**variables)


# --- the trace's context: continued, sampled, passed on ---


def test_a_clients_traceparent_is_continued_and_the_engine_gets_the_engine_spans_context() -> None:
    trace = tracer().begin({"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01", "tracestate": "vendor=x"})
    assert trace.recording and f"{trace.trace_id:032x}" == CLIENT_TRACE
    assert trace.parent is not None and f"{trace.parent.span_id:016x}" == CLIENT_SPAN
    headers = sent(trace)
    assert headers["traceparent"] == f"00-{CLIENT_TRACE}-{trace.engine_span_id:016x}-01"
    assert headers["tracestate"] == "vendor=x"


def test_an_invalid_traceparent_starts_a_new_trace() -> None:
    trace = tracer().begin({"traceparent": "00-not-a-trace-01"})
    assert trace.parent is None and trace.recording and trace.trace_id != 0


@pytest.mark.parametrize(
    ("variables", "client_flags", "recording"),
    [
        ({}, None, True),
        ({}, "00", False),  # parent-based (the default): the client's decision stands
        ({"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0"}, None, False),
        ({"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0"}, "01", True),
        ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0"}, "01", False),
        ({"OTEL_TRACES_SAMPLER": "always_off"}, None, False),
    ],
)
def test_sampling_follows_otel_traces_sampler(
    variables: dict[str, str], client_flags: str | None, recording: bool
) -> None:
    headers = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-{client_flags}"} if client_flags else {}
    trace = tracer(**variables).begin(headers)
    assert trace.recording is recording
    # Unsampled, the engine still gets the trace's context, flagged so that it records nothing either.
    assert sent(trace)["traceparent"].endswith("-01" if recording else "-00")
    assert (trace.marks != ()) is recording  # an unsampled stream is relayed as without tracing


# --- the spans ---


def test_a_streamed_chat_becomes_a_server_span_with_the_genai_attributes_and_its_children() -> None:
    trace = tracer().begin({"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
    sent(trace)
    trace.read({"id": "chatcmpl-1", "model": "nemotron", "choices": [{"index": 0, "finish_reason": "length"}]})
    spans = decoded(trace.spans(finished_record(), 200, ms(41)))
    server, key_check, admission, engine = spans
    assert (server.name, server.kind, server.parent_span_id) == ("chat nemotron", "SERVER", CLIENT_SPAN)
    assert {span.trace_id for span in spans} == {CLIENT_TRACE}
    assert server.attributes == {
        "http.request.method": "POST",
        "http.response.status_code": 200,
        "http.route": "/v1/chat/completions",
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "openai",
        "gen_ai.request.model": "nemotron",
        "gen_ai.request.max_tokens": 64,
        "gen_ai.usage.input_tokens": 12,
        "gen_ai.usage.output_tokens": 5,
        "gen_ai.response.id": "chatcmpl-1",
        "gen_ai.response.model": "nemotron",
        "gen_ai.response.finish_reasons": ["length"],
        "nemotron.request_id": "req-1",
        "nemotron.api": "chat",
        "nemotron.stream": True,
        "nemotron.key.name": "team-a",
        "nemotron.priority": 2,
    }
    assert (server.start_ns, server.end_ns) == (WALL_START, WALL_START + 41_000_000)
    first = server.event("first_chunk_sent")
    assert first is not None and first.time_ns == WALL_START + 11_000_000
    assert (key_check.name, key_check.parent_span_id, key_check.end_ns - key_check.start_ns) == (
        "key check",
        server.span_id,
        1_000_000,
    )
    assert (admission.name, admission.start_ns - WALL_START, admission.end_ns - WALL_START) == (
        "admission",
        2_000_000,
        3_000_000,
    )
    assert admission.attributes == {"nemotron.priority": 2}
    assert (engine.name, engine.kind, engine.parent_span_id) == ("POST /v1/chat/completions", "CLIENT", server.span_id)
    assert engine.span_id == f"{trace.engine_span_id:016x}"  # what vLLM's span names as its parent
    assert [(e.name, e.time_ns - WALL_START) for e in engine.events] == [
        ("connected", 4_000_000),
        ("first_byte", 10_000_000),
        ("last_byte", 40_000_000),
    ]
    assert engine.attributes["server.port"] == 8001 and engine.attributes["nemotron.engine_request_id"] == "req-1-abcd"
    assert len({span.span_id for span in spans}) == 4


def test_the_engine_span_names_the_replica_that_answered() -> None:
    trace = tracer().begin({})
    sent(trace)
    record = finished_record(replica="http://10.0.0.7:8002")
    engine = decoded(trace.spans(record, 200, ms(41)))[-1]
    assert engine.kind == "CLIENT"
    assert (engine.attributes["server.address"], engine.attributes["server.port"]) == ("10.0.0.7", 8002)
    assert engine.attributes["nemotron.replica"] == "http://10.0.0.7:8002"


def test_each_api_names_its_operation_and_finish_reason() -> None:
    answers = {
        "completions": {"id": "cmpl-1", "choices": [{"text": "x", "finish_reason": "stop"}]},
        "responses": {
            "type": "response.completed",
            "response": {"object": "response", "id": "resp_1", "status": "incomplete"}
            | {"incomplete_details": {"reason": "max_output_tokens"}},
        },
        "messages": {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 5}},
    }
    expected = {
        "completions": ("text_completion", "openai", ["stop"]),
        "responses": ("chat", "openai", ["max_output_tokens"]),
        "messages": ("chat", "anthropic", ["end_turn"]),
    }
    for api, answer in answers.items():
        trace = tracer().begin({})
        sent(trace)
        if api == "messages":
            trace.read({"type": "message_start", "message": {"id": "msg_1", "model": "nemotron"}})
        trace.read(answer)
        server = decoded(trace.spans(finished_record(api=api, route=f"/v1/{api}"), 200, ms(41)))[0]
        attributes = server.attributes
        assert (
            attributes["gen_ai.operation.name"],
            attributes["gen_ai.provider.name"],
            attributes["gen_ai.response.finish_reasons"],
        ) == expected[api], api
    assert attributes["gen_ai.response.id"] == "msg_1"


def test_a_token_count_is_no_genai_operation() -> None:
    trace = tracer().begin({})
    trace.sending({}, ms(3), None, b"{}", generates=False)
    record = finished_record(api="messages", route="/v1/messages/count_tokens", completion_tokens=None)
    server = decoded(trace.spans(record, 200, ms(5)))[0]
    assert server.name == "POST /v1/messages/count_tokens" and "gen_ai.operation.name" not in server.attributes


def test_a_refused_request_has_no_engine_span_and_says_why() -> None:
    trace = tracer().begin({})
    record = finished_record(engine_connected_at=None, engine_answered_at=None, first_chunk_at=None, cause="tokens")
    record.engine_ended_at = record.prompt_tokens = record.completion_tokens = None
    spans = decoded(trace.spans(record, 429, ms(5)))
    assert [span.name for span in spans] == ["chat nemotron", "key check", "admission"]
    server, _, admission = spans
    assert server.attributes["error.type"] == "tokens" and server.status_code == 0  # a 4xx is the client's
    assert admission.attributes["error.type"] == "tokens" and admission.status_code == 2
    assert admission.end_ns == WALL_START + 5_000_000


def test_a_key_refused_ends_the_key_check_with_the_request() -> None:
    trace = tracer().begin({})
    record = RequestRecord(request_id="r", started_at=ms(0), api="chat", route="/v1/chat/completions")
    record.cause = "unknown"
    key_check = decoded(trace.spans(record, 401, ms(2)))[1]
    assert (key_check.end_ns - key_check.start_ns, key_check.attributes) == (2_000_000, {"error.type": "unknown"})


def test_an_engine_failure_and_a_client_gone_are_marked() -> None:
    trace = tracer().begin({})
    sent(trace)
    record = finished_record(engine_error=EngineErrorKind.MID_STREAM, client_gone_at=ms(30))
    server, *_, engine = decoded(trace.spans(record, 499, ms(31)))
    assert server.attributes["nemotron.client_disconnected"] is True and server.attributes["error.type"] == "mid_stream"
    gone = server.event("client_disconnected")
    assert gone is not None and gone.time_ns == WALL_START + 30_000_000
    assert engine.status_code == 2 and engine.status_message == "mid_stream"
    assert [event.name for event in engine.events] == ["connected", "first_byte"]  # no last byte: it broke


def test_a_5xx_is_an_error_of_the_server_span() -> None:
    trace = tracer().begin({})
    sent(trace)
    server = decoded(trace.spans(finished_record(engine_error=EngineErrorKind.REFUSED), 503, ms(6)))[0]
    assert (server.status_code, server.status_message) == (2, "refused")


def test_no_text_no_key_and_no_header_is_ever_in_the_spans_unless_text_is_captured() -> None:
    body = b'{"messages":[{"role":"user","content":"the secret plan"}]}'
    trace = tracer().begin({"authorization": f"Bearer {SECRET}", "x-api-key": SECRET})
    sent(trace, body=body)
    trace.read({"choices": [{"delta": {"content": "classified answer"}, "finish_reason": "stop"}]})
    dump = repr(decoded(trace.spans(finished_record(), 200, ms(41))))
    for never in (SECRET, "secret plan", "classified answer", "Authorization", "authorization"):
        assert never not in dump


def test_captured_text_follows_the_genai_message_shapes() -> None:
    trace = tracer(capture=True).begin({})
    assert trace.marks == (b"data:",)  # every stream event is read for its text
    sent(trace, body=b'{"messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Hi"}]}')
    for piece in ("Hel", "lo"):
        trace.read({"choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]})
    trace.read({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    attributes = decoded(trace.spans(finished_record(), 200, ms(41)))[0].attributes
    assert attributes["gen_ai.input.messages"] == (
        '[{"role":"system","parts":[{"type":"text","content":"Be brief."}]},'
        '{"role":"user","parts":[{"type":"text","content":"Hi"}]}]'
    )
    assert attributes["gen_ai.output.messages"] == (
        '[{"role":"assistant","parts":[{"type":"text","content":"Hello"}],"finish_reason":"stop"}]'
    )


def test_captured_input_of_each_api() -> None:
    assert input_attributes(b'{"prompt":"Once"}') == {
        "gen_ai.input.messages": '[{"role":"user","parts":[{"type":"text","content":"Once"}]}]'
    }
    responses = input_attributes(b'{"input":"Hi","instructions":"Be brief."}')
    assert responses["gen_ai.system_instructions"] == '[{"type":"text","content":"Be brief."}]'
    messages = input_attributes(b'{"system":"S","messages":[{"role":"user","content":[{"type":"text","text":"Hi"}]}]}')
    assert messages["gen_ai.input.messages"] == '[{"role":"user","parts":[{"type":"text","content":"Hi"}]}]'
    assert input_attributes(b"not json") == {}
    text = OutputText()
    for event in (
        {"type": "response.output_text.delta", "delta": "a"},
        {"type": "content_block_delta", "delta": {"type": "text_delta", "text": "b"}},
    ):
        text.read(event)
    assert '"content":"ab"' in text.attribute([])


def test_unsampled_requests_build_nothing_and_read_nothing() -> None:
    metrics = GatewayMetrics()
    trace = tracer(metrics, OTEL_TRACES_SAMPLER="always_off").begin({})
    trace.read({"choices": [{"finish_reason": "stop"}]})
    trace.end(finished_record(), 200, ms(41))
    assert (
        metrics.registry.get_sample_value("nemotron_gateway_trace_spans_dropped_total", {"reason": "queue_full"}) == 0
    )


# --- the export queue ---


def spans_of(count: int) -> list[ReadableSpan]:
    context = SpanContext(1, 2, False, TraceFlags(TraceFlags.SAMPLED))
    return [ReadableSpan(name=f"s{n}", context=context) for n in range(count)]


def dropped(metrics: GatewayMetrics, reason: str) -> float | None:
    return metrics.registry.get_sample_value("nemotron_gateway_trace_spans_dropped_total", {"reason": reason})


def test_a_full_queue_drops_a_requests_spans_whole_and_counts_them() -> None:
    metrics = GatewayMetrics()
    exporter = Collected()
    batcher = SpanBatcher(exporter, otlp(OTEL_BSP_MAX_QUEUE_SIZE="5", OTEL_BSP_MAX_EXPORT_BATCH_SIZE="5"), metrics)
    batcher.add(spans_of(4))
    batcher.add(spans_of(4))  # no room for all four: none of them
    assert dropped(metrics, "queue_full") == 4
    batcher.start()
    batcher.stop(timeout=5)
    assert [len(batch) for batch in exporter.batches] == [4] and exporter.shut.is_set()
    assert metrics.registry.get_sample_value("nemotron_gateway_trace_spans_exported_total") == 4


def test_spans_the_collector_refuses_are_counted_as_dropped() -> None:
    metrics = GatewayMetrics()
    batcher = SpanBatcher(Collected(SpanExportResult.FAILURE), otlp(), metrics)
    batcher.start()
    batcher.add(spans_of(3))
    batcher.stop(timeout=5)
    assert dropped(metrics, "export_failed") == 3 and dropped(metrics, "shutdown") == 0


def test_spans_left_at_a_stop_that_cannot_export_are_counted() -> None:
    metrics = GatewayMetrics()
    batcher = SpanBatcher(Collected(), otlp(), metrics)  # never started: nothing can go out
    batcher.add(spans_of(2))
    batcher.stop(timeout=0.1)
    batcher.add(spans_of(1))  # after the stop
    assert dropped(metrics, "shutdown") == 3


def test_the_exporters_own_log_is_throttled() -> None:
    now = [0.0]
    throttle = LogThrottle(60, clock=lambda: now[0])
    record = logging.LogRecord("x", logging.WARNING, __file__, 1, "retrying", (), None)
    passed = []
    for at in (0, 1, 59, 60, 61, 125):
        now[0] = at
        passed.append(throttle.filter(record))
    assert passed == [True, False, False, True, False, True]


# --- the record's marks ---


def test_a_client_gone_is_marked_once_on_the_records_clock() -> None:
    record = RequestRecord(request_id="r", started_at=0.0)
    assert not record.client_disconnected and record.client_gone_at is None
    record.client_disconnected = True
    first = record.client_gone_at
    record.client_disconnected = True
    assert record.client_disconnected and first is not None and record.client_gone_at == first


# --- vLLM's own tracing ---


def test_the_engine_is_pointed_at_the_same_collector_only_when_tracing_is_on(monkeypatch: pytest.MonkeyPatch) -> None:
    argv, env = ["vllm", "serve"], {"PATH": "/bin", "OTEL_SERVICE_NAME": "nemotron-gateway"}
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    assert with_tracing(Settings(), argv, env) == (argv, env)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318/")
    traced_argv, traced_env = with_tracing(Settings(), argv, env)
    assert traced_argv == [*argv, ENDPOINT_FLAG, "http://127.0.0.1:4318/v1/traces"]
    assert traced_env == {
        "PATH": "/bin",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
        "OTEL_SERVICE_NAME": "vllm",
        "OTEL_TRACES_SAMPLER": "parentbased_always_off",
    }
    own = [*argv, f"{ENDPOINT_FLAG}=http://elsewhere:4318/v1/traces"]
    assert with_tracing(Settings(), own, env) == (own, env)
    off = Settings(tracing=TracingSettings(engine=False))
    assert with_tracing(off, argv, env) == (argv, env)


def test_a_bad_otel_variable_stops_serve_and_the_engine_before_they_start(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    for verb in (["serve"], ["engine"], ["up"]):
        assert cli.main([*verb, "--port", "1"] if verb == ["serve"] else verb) == 2
        assert "OTLP protocol 'grpc'" in capsys.readouterr().err


# --- the middleware: the trace id in the access line, the spans after the last byte ---


class Ended:
    """A request trace that only notes when it was ended."""

    trace_id = int(CLIENT_TRACE, 16)
    recording = True
    marks = ()

    def __init__(self, wire: list[str]) -> None:
        self.wire = wire
        self.ended: tuple[int, float] | None = None

    def read(self, event: dict[str, Any]) -> None:
        pass

    def end(self, record: RequestRecord, status: int, ended_at: float) -> None:
        self.wire.append("spans built")
        self.ended = (status, ended_at)


async def test_the_spans_are_built_once_the_last_byte_is_out_and_the_access_line_names_the_trace(
    caplog: pytest.LogCaptureFixture,
) -> None:
    wire: list[str] = []
    trace = Ended(wire)

    async def answer(scope: dict[str, Any], receive: object, send: Send) -> None:
        scope["state"]["record"].trace = trace
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}", "more_body": False})

    async def sent(message: Message) -> None:
        wire.append(message["type"])

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    for log_format in ("text", "json"):
        wire.clear()
        middleware = RequestContextMiddleware(
            answer,
            GatewayMetrics(),
            routes=frozenset({"/v1/chat/completions"}),
            http=HttpSettings(),
            log_format=log_format,
        )
        scope = {"type": "http", "path": "/v1/chat/completions", "method": "POST", "headers": []}
        with caplog.at_level(logging.INFO, logger="gateway.access"):
            await middleware(scope, receive, sent)
        assert wire == ["http.response.start", "http.response.body", "spans built"]
        assert trace.ended is not None and trace.ended[0] == 200
        line = caplog.records[-1].getMessage()
        assert (f'"trace_id":"{CLIENT_TRACE}"' if log_format == "json" else f" trace={CLIENT_TRACE}") in line
