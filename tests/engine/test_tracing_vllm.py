"""One trace per request, from the client through the gateway into vLLM: `nemotron-gateway up` with the OTEL_* variables
pointing at a real OTLP receiver (tests/otlp.py), the real `vllm serve` (CPU build, demo model) started by the
supervisor with its own tracing. For a streamed chat, a streamed Responses call and a streamed Messages call, the
gateway's spans and vLLM's `llm_request` share the client's trace id, vLLM's span is a child of the gateway's engine
span, and the token counts agree with what the client got; vLLM traces nothing the gateway did not sample (its
probes, its start). One engine start.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import anthropic
import openai
import pytest

from tests.engine.conftest import CACHE_ROOT
from tests.engine.stacks import running_up, up_settings
from tests.otlp import Receiver, Span, running_receiver
from tests.procs import free_port

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

MODEL = "nemotron"
CLIENT_SPAN = "00f067aa0ba902b7"
HI = [{"role": "user", "content": "Say hi"}]
# vLLM exports its spans in batches: its schedule delay shortened so a test waits for them less.
EXPORT_DELAY_MS = "200"


@dataclass
class Stack:
    gateway: str
    key: str
    receiver: Receiver


@pytest.fixture(scope="module")
def stack(demo_model_dir: str, redis_url: str) -> Iterator[Stack]:
    engine_port, gateway_port = free_port(), free_port()
    with running_receiver() as receiver:
        env = up_settings(
            demo_model_dir,
            redis_url,
            engine_port=engine_port,
            gateway_port=gateway_port,
            state_dir=CACHE_ROOT / "engine-tests-tracing",
        )
        env |= {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_BSP_SCHEDULE_DELAY": EXPORT_DELAY_MS}
        with running_up(env, key_prefix="tracing") as (_, key):
            yield Stack(f"http://127.0.0.1:{gateway_port}", key, receiver)


def traceparent() -> tuple[str, dict[str, str]]:
    trace_id = uuid.uuid4().hex
    return trace_id, {"traceparent": f"00-{trace_id}-{CLIENT_SPAN}-01"}


def joined_trace(receiver: Receiver, trace_id: str) -> tuple[Span, Span, Span]:
    """The gateway's server and engine spans of `trace_id` and vLLM's span, once all arrived (the wait only stops a
    hung test: vLLM exports every EXPORT_DELAY_MS)."""

    def complete(spans: list[Span]) -> bool:
        return len(spans) >= 5 and any(span.service == "vllm" for span in spans)

    spans = receiver.wait_for(complete, timeout=60, trace_id=trace_id)
    server = next(span for span in spans if span.service == "nemotron-gateway" and span.kind == "SERVER")
    engine = next(span for span in spans if span.service == "nemotron-gateway" and span.kind == "CLIENT")
    vllm = next(span for span in spans if span.service == "vllm")
    return server, engine, vllm


def assert_nested(server: Span, engine: Span, vllm: Span, counts: tuple[int, int]) -> None:
    assert server.parent_span_id == CLIENT_SPAN and engine.parent_span_id == server.span_id
    assert (vllm.name, vllm.kind, vllm.parent_span_id) == ("llm_request", "SERVER", engine.span_id)
    assert engine.start_ns <= vllm.start_ns  # vLLM took the request after the gateway sent it
    assert (server.attributes["gen_ai.usage.input_tokens"], server.attributes["gen_ai.usage.output_tokens"]) == counts
    # vLLM's own count (its attribute names predate the conventions' input/output names).
    assert (vllm.attributes["gen_ai.usage.prompt_tokens"], vllm.attributes["gen_ai.usage.completion_tokens"]) == counts
    assert server.attributes["gen_ai.response.finish_reasons"]


def test_a_streamed_chat_is_one_trace_from_the_client_into_vllms_scheduler(stack: Stack) -> None:
    trace_id, headers = traceparent()
    with openai.OpenAI(base_url=f"{stack.gateway}/v1", api_key=stack.key, max_retries=0, timeout=120) as sdk:
        chunks = list(
            sdk.chat.completions.create(
                model=MODEL,
                messages=HI,
                max_tokens=8,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_headers=headers,
            )
        )
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens > 0
    server, engine, vllm = joined_trace(stack.receiver, trace_id)
    assert server.name == f"chat {MODEL}" and server.attributes["gen_ai.request.max_tokens"] == 8
    assert_nested(server, engine, vllm, (usage.prompt_tokens, usage.completion_tokens))
    # vLLM's timings of the request: its queue, prefill and decode.
    for timing in ("time_in_queue", "time_in_model_prefill", "time_in_model_decode", "time_to_first_token"):
        assert vllm.attributes[f"gen_ai.latency.{timing}"] >= 0


def test_a_streamed_responses_call_is_one_trace(stack: Stack) -> None:
    trace_id, headers = traceparent()
    with openai.OpenAI(base_url=f"{stack.gateway}/v1", api_key=stack.key, max_retries=0, timeout=120) as sdk:
        events = list(
            sdk.responses.create(
                model=MODEL, input="Say hi", max_output_tokens=8, temperature=0, stream=True, extra_headers=headers
            )
        )
    final = events[-1].response  # type: ignore[union-attr]
    assert final.usage is not None
    server, engine, vllm = joined_trace(stack.receiver, trace_id)
    assert server.attributes["nemotron.api"] == "responses" and server.attributes["gen_ai.response.id"] == final.id
    assert_nested(server, engine, vllm, (final.usage.input_tokens, final.usage.output_tokens))


def test_a_streamed_messages_call_is_one_trace(stack: Stack) -> None:
    trace_id, headers = traceparent()
    with anthropic.Anthropic(
        base_url=stack.gateway, default_headers={"x-api-key": stack.key, **headers}, max_retries=0, timeout=120
    ) as claude:
        with claude.messages.stream(model=MODEL, max_tokens=8, messages=HI) as stream:
            final = stream.get_final_message()
    server, engine, vllm = joined_trace(stack.receiver, trace_id)
    assert (server.attributes["gen_ai.provider.name"], server.attributes["nemotron.api"]) == ("anthropic", "messages")
    assert_nested(server, engine, vllm, (final.usage.input_tokens, final.usage.output_tokens))


def test_vllm_traces_only_what_the_gateway_sampled(stack: Stack) -> None:
    # By now the gateway's generation probes have run and the engine has started: none of that is in a trace.
    gateway_spans = {span.span_id for span in stack.receiver.spans() if span.service == "nemotron-gateway"}
    vllm = [span for span in stack.receiver.spans() if span.service == "vllm"]
    assert vllm and all(span.parent_span_id in gateway_spans for span in vllm), [
        (span.name, span.parent_span_id) for span in vllm if span.parent_span_id not in gateway_spans
    ]
