"""The gateway as a real uvicorn server in front of the fake engine, driven by the OpenAI SDK and raw httpx."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest

from tests.procs import FakeEngineControl, ServerProcess, async_wait_until, free_port, run_gateway, wait_until

MODEL = "nemotron-test"
ALIAS = "nemotron"

GATEWAY_ENV = {
    # Keys and limits have their own tests (test_keys_limits.py); these are about the request path.
    "NEMOTRON_AUTH__ENABLED": "false",
    "NEMOTRON_MODEL_ALIASES": f'["{ALIAS}"]',
    "NEMOTRON_RELAY__HEARTBEAT_INTERVAL": "0.3",
    "NEMOTRON_RELAY__CHUNK_TIMEOUT": "2",
    "NEMOTRON_RELAY__FIRST_BYTE_TIMEOUT": "4",
    "NEMOTRON_RELAY__PROBE_INTERVAL": "0.2",
    "NEMOTRON_RELAY__RETRY_AFTER": "3",
    "NEMOTRON_MAX_BODY_BYTES": "65536",
}


@pytest.fixture(scope="module")
def gateway(fake_engine: FakeEngineControl, redis_url: str) -> Iterator[ServerProcess]:
    with run_gateway(fake_engine.base_url, redis_url, env=GATEWAY_ENV) as proc:
        yield proc


@pytest.fixture
def base_url(gateway: ServerProcess, engine: FakeEngineControl) -> str:
    # `engine` resets the fake's records and health before each test.
    return f"http://127.0.0.1:{gateway.port}"


@pytest.fixture
def client(base_url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=20) as sdk:
        yield sdk


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], **extra}


def sse_events(raw: bytes) -> list[bytes]:
    """The data payloads of an SSE byte stream (comments dropped)."""
    return [line[6:] for line in raw.split(b"\n") if line.startswith(b"data: ")]


# --- the OpenAI SDK, sync and async, stream and non-stream ---


def test_sdk_chat_completion(client: openai.OpenAI, engine: FakeEngineControl) -> None:
    answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert answer.choices[0].message.content == "tok0 tok1 tok2 tok3"
    assert answer.usage is not None and answer.usage.completion_tokens == 4
    sent = engine.requests()[-1]["body"]
    assert sent["messages"][0] == {"role": "system", "content": "You are a helpful assistant."}
    assert "stream_options" not in sent


def test_sdk_stream_hides_the_usage_chunk_it_did_not_ask_for(client: openai.OpenAI, engine: FakeEngineControl) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "tok0 tok1 tok2 tok3 tok4"
    assert all(c.choices for c in chunks), "the usage-only chunk the gateway asked for must not reach the client"
    assert engine.requests()[-1]["body"]["stream_options"] == {"include_usage": True}


def test_sdk_stream_with_usage_when_asked(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "one two three"}],
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 3


async def test_async_sdk_stream_and_completion(base_url: str) -> None:
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0) as sdk:
        answer = await sdk.completions.create(model=MODEL, prompt="say something", max_tokens=2)
        assert answer.choices[0].text == "tok0 tok1"
        stream = await sdk.chat.completions.create(
            model=ALIAS, messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert text == "tok0 tok1 tok2"
        completion_stream = await sdk.completions.create(model=MODEL, prompt="x", max_tokens=2, stream=True)
        assert "".join([c.choices[0].text async for c in completion_stream]) == "tok0 tok1"


def test_sdk_models_lists_served_name_and_aliases(client: openai.OpenAI) -> None:
    ids = [m.id for m in client.models.list()]
    assert ids == [MODEL, ALIAS]


def test_alias_is_rewritten_and_unknown_fields_pass_through(client: openai.OpenAI, engine: FakeEngineControl) -> None:
    client.chat.completions.create(
        model=ALIAS,
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        max_tokens=1,
        extra_body={"top_k": 5, "repetition_penalty": 1.1, "chat_template_kwargs": {"enable_thinking": False}},
    )
    sent = engine.requests()[-1]["body"]
    assert sent["model"] == MODEL
    assert sent["top_k"] == 5 and sent["repetition_penalty"] == 1.1
    assert sent["chat_template_kwargs"] == {"enable_thinking": False}
    assert [m["role"] for m in sent["messages"]] == ["system", "user"], "no second system message when one is sent"


# --- errors reach the SDK as the right exception class, with a readable message ---


@pytest.mark.parametrize(
    ("messages", "param", "phrase"),
    [
        ([{"role": "User", "content": "hi"}], "messages[0].role", "lowercase"),
        ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": 7}], "messages[1].content", "string"),
        ([], "messages", "at least one message"),
    ],
)
def test_sdk_bad_request(
    client: openai.OpenAI, engine: FakeEngineControl, messages: Any, param: str, phrase: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=messages)
    assert caught.value.status_code == 400
    body = caught.value.body
    assert isinstance(body, dict) and body["param"] == param
    assert phrase in caught.value.message
    assert engine.requests() == [], "an invalid request must not reach the engine"


def test_sdk_unknown_model_is_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match=MODEL):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        (b"[1, 2]", None),
        (b'"text"', None),
        (orjson.dumps(chat(temperature="hot")), "temperature"),
        (orjson.dumps(chat(stream="yes")), "stream"),
        (orjson.dumps(chat(stop=5)), "stop"),
        (orjson.dumps(chat(max_tokens=0)), "max_tokens"),
        (orjson.dumps(chat(max_tokens=100_000)), "max_tokens"),
        (orjson.dumps(chat(n=0)), "n"),
        (orjson.dumps(chat(n=100)), "n"),
        (orjson.dumps({"messages": [{"role": "user", "content": "x"}]}), "model"),
        (orjson.dumps(chat(messages=[{"role": "tool"}])), "messages[0]"),
    ],
)
def test_raw_bad_request_is_a_400_envelope(base_url: str, body: bytes, param: str | None) -> None:
    response = httpx.post(f"{base_url}/v1/chat/completions", content=body, timeout=5)
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert len(error["message"]) > 20


def test_body_over_the_limit_is_413(client: openai.OpenAI, base_url: str) -> None:
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x" * 70_000}])
    assert caught.value.status_code == 413
    assert "limit" in caught.value.message
    # Without a Content-Length (chunked upload) the limit holds too.
    response = httpx.post(
        f"{base_url}/v1/chat/completions", content=iter([b'{"model": "x", "pad": "', b"y" * 70_000, b'"}']), timeout=5
    )
    assert response.status_code == 413


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/invocations"),
        ("POST", "/tokenize"),
        ("POST", "/pause"),
        ("GET", "/load"),
        ("POST", "/v1/models/x"),
        ("POST", "/v1/embeddings"),
        ("GET", "/v1/chat/completions"),
    ],
)
def test_other_engine_paths_are_never_proxied(base_url: str, engine: FakeEngineControl, method: str, path: str) -> None:
    response = httpx.request(method, f"{base_url}{path}", json={"model": MODEL}, timeout=5)
    # Any other path is a 404; a served path asked with another method may be a 405. OpenAI's envelope both.
    served_elsewise = ("/v1/chat/completions", "/v1/models/x")
    allowed = {(404, "unknown_url"), (405, "method_not_allowed")} if path in served_elsewise else set()
    assert (response.status_code, response.json()["error"]["code"]) in {(404, "unknown_url"), *allowed}
    assert engine.requests() == []


def test_engine_error_passes_through_in_the_envelope(client: openai.OpenAI) -> None:
    with pytest.raises(openai.UnprocessableEntityError):
        client.chat.completions.create(**chat(extra_body={"fake_status": 422}))
    with pytest.raises(openai.InternalServerError) as caught:
        client.chat.completions.create(**chat(stream=True, extra_body={"fake_status": 500}))
    assert caught.value.status_code == 500


@pytest.mark.parametrize("stream", [False, True])
def test_vllms_dead_engine_core_answer_is_a_503_with_retry_after(base_url: str, stream: bool) -> None:
    # vLLM's API server outlives a killed EngineCore for a moment and answers 500 with this message meanwhile.
    dead = "EngineCore encountered an issue. See stack trace (above) for the root cause."
    body = chat(stream=stream, fake_status=500, fake_message=dead)
    response = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=10)
    assert response.status_code == 503
    assert response.headers["retry-after"].isdigit()
    error = response.json()["error"]
    assert error["code"] == "engine_unavailable" and "being restarted" in error["message"]


# --- streaming is incremental, and disconnects reach the engine ---


def test_stream_is_incremental(base_url: str, engine: FakeEngineControl) -> None:
    # 20 tokens a second apart: the first data must reach the client while the engine still generates the rest (a
    # buffered stream would bring it only once the engine had finished), and the client leaves then.
    body = chat(max_tokens=20, stream=True, fake_token_delay=1.0)
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=30) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        first = next(line for line in response.iter_lines() if line.startswith("data: "))
        (record,) = engine.requests()
        assert not record["completed"] and record["tokens_sent"] < 20, "the first data came once the engine finished"
    assert first != "data: [DONE]"


def test_client_disconnect_mid_stream_aborts_the_engine_request(base_url: str, engine: FakeEngineControl) -> None:
    body = chat(max_tokens=200, stream=True, fake_token_delay=0.05)
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=10) as response:
        lines = response.iter_lines()
        seen = [line for _, line in zip(range(6), lines, strict=False)]
        assert any(line.startswith("data: ") for line in seen)
    record = wait_until(lambda: next((r for r in engine.requests() if r["disconnected"]), None), timeout=3)
    assert record["completed"] is False
    assert record["tokens_sent"] < 200
    assert engine.stats()["active_streams"] == 0


def test_client_disconnect_during_non_stream_request_aborts_the_engine_request(
    base_url: str, engine: FakeEngineControl
) -> None:
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base_url}/v1/chat/completions", json=chat(fake_prefill_delay=30), timeout=0.5)
    record = wait_until(lambda: next((r for r in engine.requests() if r["disconnected"]), None), timeout=3)
    assert record["completed"] is False
    metrics = httpx.get(f"{base_url}/metrics").text
    assert 'nemotron_gateway_client_disconnects_total{mode="non_stream"}' in metrics


async def test_async_sdk_disconnect_mid_stream(base_url: str, engine: FakeEngineControl) -> None:
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0) as sdk:
        stream = await sdk.chat.completions.create(
            **chat(max_tokens=200, stream=True, extra_body={"fake_token_delay": 0.05})
        )
        async for _ in stream:
            break
        await stream.close()

    async def disconnected() -> bool:
        return any(r["disconnected"] for r in await engine.arequests())

    await async_wait_until(disconnected, within=3)


def test_heartbeat_comments_during_a_long_prefill(client: openai.OpenAI, base_url: str) -> None:
    body = chat(max_tokens=2, stream=True, fake_prefill_delay=1.0)
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=10) as response:
        raw = b"".join(response.iter_raw())
    assert raw.startswith(b": keep-alive\n\n"), raw[:60]
    assert raw.count(b": keep-alive") >= 2
    assert raw.endswith(b"data: [DONE]\n\n")
    # The SDK ignores the comments.
    stream = client.chat.completions.create(**chat(max_tokens=2, stream=True, extra_body={"fake_prefill_delay": 0.8}))
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "tok0 tok1"


def test_engine_dying_mid_stream_ends_with_an_error_event(client: openai.OpenAI, base_url: str) -> None:
    body = chat(max_tokens=50, stream=True, fake_die_after=3)
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=10) as response:
        raw = b"".join(response.iter_raw())
    events = sse_events(raw)
    assert b"[DONE]" not in events
    error = orjson.loads(events[-1])["error"]
    assert error["code"] == "engine_unavailable" and "incomplete" in error["message"]
    with pytest.raises(openai.APIError, match="incomplete"):
        list(client.chat.completions.create(**chat(max_tokens=50, stream=True, extra_body={"fake_die_after": 3})))


def test_frozen_stream_ends_with_a_timeout_event(base_url: str) -> None:
    # The engine would send its next token after the client's own read timeout: only the gateway's chunk timeout
    # (2 s here) can end the stream with an event rather than the client giving up.
    body = chat(max_tokens=3, stream=True, fake_token_delay=600)
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=15) as response:
        raw = b"".join(response.iter_raw())
    assert orjson.loads(sse_events(raw)[-1])["error"]["code"] == "engine_timeout"


def test_engine_not_answering_is_a_504(client: openai.OpenAI) -> None:
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(**chat(extra_body={"fake_hang": True}))
    assert caught.value.status_code == 504
    assert "did not" in caught.value.message


# --- request ids, readiness, metrics ---


def test_request_id_is_kept_passed_on_and_returned(base_url: str, engine: FakeEngineControl) -> None:
    response = httpx.post(
        f"{base_url}/v1/chat/completions", json=chat(max_tokens=1), headers={"X-Request-ID": "req-abc.123"}
    )
    assert response.headers["x-request-id"] == "req-abc.123"
    # The engine sees the client's id with a suffix of its own (two clients may send the same id).
    assert engine.requests()[-1]["request_id"].startswith("req-abc.123-")
    generated = httpx.post(f"{base_url}/v1/chat/completions", json=chat(max_tokens=1))
    assert len(generated.headers["x-request-id"]) == 32
    assert engine.requests()[-1]["request_id"].startswith(generated.headers["x-request-id"] + "-")
    unsafe = httpx.post(
        f"{base_url}/v1/chat/completions", json=chat(max_tokens=1), headers={"X-Request-ID": "a b\t<x>"}
    )
    assert unsafe.headers["x-request-id"] != "a b\t<x>"


def test_unhealthy_engine_gives_fast_503s_and_recovers(
    client: openai.OpenAI, base_url: str, engine: FakeEngineControl
) -> None:
    engine.set_health(503)
    wait_until(lambda: httpx.get(f"{base_url}/ready").status_code == 503, timeout=3)
    ready = httpx.get(f"{base_url}/ready").json()
    assert ready["engine"]["ok"] is False and ready["redis"]["ok"] is True
    # The gauges a dashboard reads follow the verdict /ready gives, not a later tick of the pool.
    assert "nemotron_gateway_engine_up 0.0" in httpx.get(f"{base_url}/metrics").text
    with pytest.raises(openai.InternalServerError) as caught:
        client.chat.completions.create(**chat())
    assert caught.value.status_code == 503
    assert caught.value.response.headers["retry-after"] == "3"
    assert engine.requests() == []
    engine.set_health(200)
    wait_until(lambda: httpx.get(f"{base_url}/ready").status_code == 200, timeout=3)
    assert "nemotron_gateway_engine_up 1.0" in httpx.get(f"{base_url}/metrics").text
    assert client.chat.completions.create(**chat(max_tokens=1)).choices[0].message.content == "tok0"


def test_metrics_count_requests_tokens_and_engine_state(client: openai.OpenAI, base_url: str) -> None:
    client.chat.completions.create(**chat(max_tokens=3))
    text = httpx.get(f"{base_url}/metrics").text
    assert 'nemotron_gateway_requests_total{route="/v1/chat/completions",status="200"}' in text
    assert "nemotron_gateway_engine_up 1.0" in text
    completion = [
        line for line in text.splitlines() if line.startswith('nemotron_gateway_tokens_total{kind="completion"}')
    ]
    assert completion and float(completion[0].split()[-1]) >= 3
    assert "nemotron_gateway_time_to_first_token_seconds_bucket" in text
    assert "vllm:" not in text


def test_health_and_ready(base_url: str) -> None:
    assert httpx.get(f"{base_url}/health").json() == {"status": "ok"}
    ready = httpx.get(f"{base_url}/ready")
    assert ready.status_code == 200
    assert ready.json()["model"] == MODEL


def test_access_log_line_has_request_id_and_never_the_authorization_header(
    client: openai.OpenAI, gateway: ServerProcess, base_url: str
) -> None:
    secret = "sk-this-must-never-be-logged-0123456789"
    httpx.post(
        f"{base_url}/v1/chat/completions",
        json=chat(max_tokens=1),
        headers={"Authorization": f"Bearer {secret}", "X-Request-ID": "log-check-1"},
    )
    log = wait_until(lambda: gateway.log_text() if "log-check-1" in gateway.log_text() else None, timeout=3)
    line = next(line for line in log.splitlines() if "log-check-1" in line)
    assert '"POST /v1/chat/completions" 200' in line
    assert secret not in log


# --- the engine or Redis down ---


@pytest.fixture(scope="module")
def orphan_gateway() -> Iterator[str]:
    """A gateway whose engine and Redis are both missing (closed ports)."""
    dead_engine, dead_redis = free_port(), free_port()
    env = {"NEMOTRON_RELAY__RETRY_AFTER": "7", "NEMOTRON_MODEL_NAME": MODEL, "NEMOTRON_AUTH__ENABLED": "false"}
    with run_gateway(
        f"http://127.0.0.1:{dead_engine}", f"redis://127.0.0.1:{dead_redis}/0", wait_ready=False, env=env
    ) as proc:
        yield f"http://127.0.0.1:{proc.port}"


def test_ready_says_which_part_is_down(orphan_gateway: str) -> None:
    response = httpx.get(f"{orphan_gateway}/ready", timeout=5)
    assert response.status_code == 503
    body = response.json()
    assert body["engine"]["ok"] is False and "refused" in body["engine"]["reason"]
    assert body["redis"]["ok"] is False


def test_engine_down_is_a_503_with_retry_after(orphan_gateway: str) -> None:
    # Not held until the engine comes back: a request that waited would end in the SDK's timeout instead.
    with openai.OpenAI(base_url=f"{orphan_gateway}/v1", api_key="unused", max_retries=0, timeout=10) as sdk:
        with pytest.raises(openai.InternalServerError) as caught:
            sdk.chat.completions.create(**chat())
        with pytest.raises(openai.InternalServerError):
            list(sdk.chat.completions.create(**chat(stream=True)))
    assert caught.value.status_code == 503
    assert caught.value.response.headers["retry-after"] == "7"
    assert "unavailable" in caught.value.message or "not ready" in caught.value.message
