"""The real engine answers the OpenAI routes the gateway relays: usage on a chat completion, `[DONE]` on a stream."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.engine._vllm import MAX_MODEL_LEN, VllmEngine

pytestmark = [pytest.mark.engine, pytest.mark.timeout(300)]

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]


def test_models_lists_the_served_name_and_context(vllm_engine: VllmEngine) -> None:
    response = httpx.get(f"{vllm_engine.base_url}/v1/models", timeout=10.0)

    assert response.status_code == 200
    [model] = response.json()["data"]
    assert model["id"] == vllm_engine.model_name
    assert model["max_model_len"] == MAX_MODEL_LEN


def test_chat_completion_reports_usage(vllm_engine: VllmEngine) -> None:
    body = {"model": vllm_engine.model_name, "messages": MESSAGES, "max_tokens": 8, "temperature": 0}

    response = httpx.post(f"{vllm_engine.base_url}/v1/chat/completions", json=body, timeout=60.0)

    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["object"] == "chat.completion"
    assert answer["choices"][0]["message"]["role"] == "assistant"
    usage = answer["usage"]
    assert usage["prompt_tokens"] > 0
    assert 1 <= usage["completion_tokens"] <= 8
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_stream_ends_with_usage_then_done(vllm_engine: VllmEngine) -> None:
    body = {
        "model": vllm_engine.model_name,
        "messages": MESSAGES,
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }

    with httpx.stream("POST", f"{vllm_engine.base_url}/v1/chat/completions", json=body, timeout=60.0) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()

    events = [event for event in raw.split("\n\n") if event]
    assert all(event.startswith("data: ") for event in events)
    assert events[-1] == "data: [DONE]"
    usage_chunk = json.loads(events[-2].removeprefix("data: "))
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] >= 1
    chunks = [json.loads(event.removeprefix("data: ")) for event in events[:-2]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] in {"stop", "length"}
