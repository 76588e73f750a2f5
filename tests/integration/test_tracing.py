"""Tracing through real gateway processes, real Redis, the fake engine and a real OTLP receiver (tests/otlp.py): every
relayed API's spans under the client's `traceparent`, the engine request carrying the engine span's context, the
trace id in the access line, error bodies as without tracing, no key or header in any exported value, and nothing
sent or exported with tracing off.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest

from tests.integration.test_apis import PEPPER, new_key
from tests.otlp import Receiver, Span, running_receiver
from tests.procs import FakeEngineControl, ServerProcess, run_fake_engine, run_gateway, wait_until

pytestmark = pytest.mark.timeout(90)

MODEL = "nemotron-test"
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
HI = [{"role": "user", "content": "Hi there"}]
ENV = {"NEMOTRON_AUTH__SECRET": PEPPER, "NEMOTRON_RELAY__PROBE_INTERVAL": "0.2"}


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    with running_receiver() as found:
        yield found


@pytest.fixture(scope="module")
def fake(redis_url: str) -> Iterator[FakeEngineControl]:
    with run_fake_engine() as process:
        yield FakeEngineControl(process)


@pytest.fixture(scope="module")
def gateways(fake: FakeEngineControl, redis_url: str, receiver: Receiver) -> Iterator[dict[str, ServerProcess]]:
    traced = {**ENV, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_BSP_SCHEDULE_DELAY": "50"}
    with (
        run_gateway(fake.base_url, redis_url, env=traced) as on,
        run_gateway(fake.base_url, redis_url, env=ENV) as off,
    ):
        yield {"on": on, "off": off}


@pytest.fixture
def urls(gateways: dict[str, ServerProcess], fake: FakeEngineControl) -> dict[str, str]:
    fake.reset()
    return {name: f"http://127.0.0.1:{proc.port}" for name, proc in gateways.items()}


@pytest.fixture(scope="module")
def key(redis_url: str) -> str:
    return new_key(redis_url, name=f"tracing-{uuid.uuid4().hex[:8]}")


def joined(receiver: Receiver, trace_id: str, names: int = 4) -> list[Span]:
    """The gateway's spans of one trace, once all `names` arrived (a guard against a hung test, not a bound)."""
    return receiver.wait_for(lambda spans: len(spans) >= names, timeout=30, trace_id=trace_id)


def by_name(spans: list[Span]) -> dict[str, Span]:
    return {span.name: span for span in spans}


def test_a_streamed_chat_is_one_trace_under_the_clients_span_and_the_engine_gets_its_context(
    urls: dict[str, str], key: str, receiver: Receiver, fake: FakeEngineControl, gateways: dict[str, ServerProcess]
) -> None:
    headers = {"traceparent": TRACEPARENT, "x-request-id": f"trace-{uuid.uuid4().hex[:8]}"}
    with openai.OpenAI(base_url=f"{urls['on']}/v1", api_key=key, max_retries=0, timeout=20) as sdk:
        chunks = list(
            sdk.chat.completions.create(
                model=MODEL,
                messages=HI,
                stream=True,
                max_tokens=7,
                stream_options={"include_usage": True},
                extra_headers=headers,
            )
        )
    usage = chunks[-1].usage
    assert usage is not None
    spans = by_name(joined(receiver, CLIENT_TRACE))
    server, engine = spans[f"chat {MODEL}"], spans["POST /v1/chat/completions"]
    assert server.kind == "SERVER" and server.parent_span_id == CLIENT_SPAN
    assert {spans["key check"].parent_span_id, spans["admission"].parent_span_id, engine.parent_span_id} == {
        server.span_id
    }
    attributes = server.attributes
    assert (attributes["gen_ai.usage.input_tokens"], attributes["gen_ai.usage.output_tokens"]) == (
        usage.prompt_tokens,
        usage.completion_tokens,
    )
    assert attributes["gen_ai.response.finish_reasons"] == ["length"] and attributes["gen_ai.request.max_tokens"] == 7
    assert attributes["nemotron.request_id"] == headers["x-request-id"] and attributes["nemotron.stream"] is True
    assert [event.name for event in server.events] == ["first_chunk_sent"]
    assert [event.name for event in engine.events] == ["connected", "first_byte", "last_byte"]
    # The engine request carried the engine span's context: vLLM's span nests under it.
    sent = fake.request(engine.attributes["nemotron.engine_request_id"])["headers"]
    assert sent["traceparent"] == f"00-{CLIENT_TRACE}-{engine.span_id}-01"
    assert f"trace={CLIENT_TRACE}" in gateways["on"].log_text()


@pytest.mark.parametrize("api", ["completions", "responses", "messages"])
def test_every_relayed_api_has_its_server_span_with_the_counts_the_client_got(
    urls: dict[str, str], key: str, receiver: Receiver, api: str
) -> None:
    trace_id = uuid.uuid4().hex
    headers = {"traceparent": f"00-{trace_id}-{CLIENT_SPAN}-01"}
    if api == "messages":
        with anthropic.Anthropic(
            base_url=urls["on"], default_headers={"x-api-key": key, **headers}, max_retries=0, timeout=20
        ) as claude:
            with claude.messages.stream(model=MODEL, max_tokens=6, messages=HI) as stream:
                final = stream.get_final_message()
        counts = (final.usage.input_tokens, final.usage.output_tokens)
        name, operation = f"chat {MODEL}", ("chat", "anthropic")
    else:
        with openai.OpenAI(base_url=f"{urls['on']}/v1", api_key=key, max_retries=0, timeout=20) as sdk:
            if api == "completions":
                answer = sdk.completions.create(model=MODEL, prompt="Once", max_tokens=6, extra_headers=headers)
                assert answer.usage is not None
                counts = (answer.usage.prompt_tokens, answer.usage.completion_tokens)
                name, operation = f"text_completion {MODEL}", ("text_completion", "openai")
            else:
                events = list(
                    sdk.responses.create(
                        model=MODEL, input="Hi", max_output_tokens=6, stream=True, extra_headers=headers
                    )
                )
                response = events[-1].response  # type: ignore[union-attr]
                assert response.usage is not None
                counts = (response.usage.input_tokens, response.usage.output_tokens)
                name, operation = f"chat {MODEL}", ("chat", "openai")
    server = by_name(joined(receiver, trace_id))[name]
    attributes = server.attributes
    assert (attributes["gen_ai.operation.name"], attributes["gen_ai.provider.name"]) == operation
    assert (attributes["gen_ai.usage.input_tokens"], attributes["gen_ai.usage.output_tokens"]) == counts
    assert attributes["gen_ai.response.finish_reasons"] and "gen_ai.response.id" in attributes
    assert server.parent_span_id == CLIENT_SPAN and server.service == "nemotron-gateway"


def test_an_error_answers_as_without_tracing_and_its_span_says_why(
    urls: dict[str, str], key: str, receiver: Receiver
) -> None:
    trace_id = uuid.uuid4().hex
    body = {"model": MODEL, "messages": [{"role": "User", "content": "Hi"}]}
    answers = [
        httpx.post(
            f"{url}/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {key}", "traceparent": f"00-{trace_id}-{CLIENT_SPAN}-01"},
            timeout=20,
        )
        for url in (urls["on"], urls["off"])
    ]
    assert answers[0].status_code == answers[1].status_code == 400
    assert answers[0].content == answers[1].content and trace_id not in answers[0].text
    assert set(answers[0].headers) == set(answers[1].headers)
    server = by_name(joined(receiver, trace_id, names=2))["chat"]  # no model: the request never got that far
    assert server.attributes["http.response.status_code"] == 400 and server.attributes["error.type"]


def test_no_key_and_no_header_is_in_any_exported_value(urls: dict[str, str], key: str, receiver: Receiver) -> None:
    trace_id = uuid.uuid4().hex
    for auth in ({"Authorization": f"Bearer {key}"}, {"x-api-key": key}, {"Authorization": "Bearer sk-wrong-1234"}):
        httpx.post(
            f"{urls['on']}/v1/chat/completions",
            json={"model": MODEL, "messages": HI, "max_tokens": 2},
            headers={**auth, "traceparent": f"00-{trace_id}-{CLIENT_SPAN}-01"},
            timeout=20,
        )
    spans = receiver.wait_for(lambda found: len(found) >= 10, timeout=30, trace_id=trace_id)
    exported = repr(spans)
    for never in (key, key[10:], "sk-wrong-1234", "Bearer", "Hi there"):
        assert never not in exported


def test_tracing_off_sends_no_context_and_exports_nothing(
    urls: dict[str, str], key: str, receiver: Receiver, fake: FakeEngineControl
) -> None:
    trace_id = uuid.uuid4().hex
    request_id = f"untraced-{uuid.uuid4().hex[:8]}"
    headers = {"Authorization": f"Bearer {key}", "x-request-id": request_id}
    answer = httpx.post(
        f"{urls['off']}/v1/chat/completions",
        json={"model": MODEL, "messages": HI, "max_tokens": 2},
        headers={**headers, "traceparent": f"00-{trace_id}-{CLIENT_SPAN}-01"},
        timeout=20,
    )
    assert answer.status_code == 200
    engine_request = wait_until(
        lambda: next((r for r in fake.requests() if (r["request_id"] or "").startswith(request_id)), None),
        timeout=10,
        message="the fake engine never saw the request",
    )
    # The client's own header is not the gateway's to forward: the engine request goes as it did before tracing.
    assert "traceparent" not in engine_request["headers"]
    # A request traced after it, on the traced gateway, arrives; the untraced one never does.
    httpx.post(
        f"{urls['on']}/v1/chat/completions",
        json={"model": MODEL, "messages": HI, "max_tokens": 2},
        headers={"Authorization": f"Bearer {key}", "traceparent": f"00-{trace_id}-{CLIENT_SPAN}-01"},
        timeout=20,
    )
    joined(receiver, trace_id)
    assert all(span.attributes.get("nemotron.request_id") != request_id for span in receiver.spans())
