"""The fake vLLM engine itself: response shapes, stream order, faults, and the disconnect records tests rely on."""

from __future__ import annotations

import json
import signal
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tests.procs import FakeEngineControl, ServerProcess, ServerProcessError, async_wait_until, run_fake_engine

pytestmark = pytest.mark.timeout(15)

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "three word prompt"}]


@pytest.fixture
async def client(engine: FakeEngineControl) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=engine.base_url, timeout=5.0) as client:
        yield client


def sse_payloads(raw: str) -> list[str]:
    assert raw.endswith("\n\n"), raw[-80:]
    events = raw.split("\n\n")[:-1]
    assert all(event.startswith("data: ") for event in events), events
    return [event.removeprefix("data: ") for event in events]


async def test_health_and_models(client: httpx.AsyncClient) -> None:
    health = await client.get("/health")
    assert (health.status_code, health.content) == (200, b"")

    models = (await client.get("/v1/models")).json()
    assert models["object"] == "list"
    (card,) = models["data"]
    assert card["id"] == card["root"] == "nemotron-test"
    assert (card["object"], card["owned_by"], card["parent"], card["max_model_len"]) == ("model", "vllm", None, 4096)


async def test_chat_stream_orders_role_tokens_usage_then_done(client: httpx.AsyncClient) -> None:
    body = {"messages": MESSAGES, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    response = await client.post(CHAT, json=body)

    assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
    payloads = sse_payloads(response.text)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [c["choices"][0]["delta"]["content"] for c in chunks[1:4]]
    assert "".join(deltas) == "tok0 tok1 tok2"
    assert [c["choices"][0]["finish_reason"] for c in chunks[:4]] == [None, None, None, "length"]
    assert all(c["usage"] is None for c in chunks[:4])
    assert chunks[4]["choices"] == []
    assert chunks[4]["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}


async def test_completion_stream_without_include_usage_has_no_usage_key(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/completions", json={"prompt": "a b", "stream": True})

    payloads = sse_payloads(response.text)
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert payloads[-1] == "[DONE]" and len(chunks) == 16
    assert all("usage" not in c and c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize(
    ("path", "body", "text_of"),
    [
        (CHAT, {"messages": MESSAGES, "max_completion_tokens": 2}, lambda c: c["message"]["content"]),
        ("/v1/completions", {"prompt": "one two three", "max_tokens": 2}, lambda c: c["text"]),
    ],
)
async def test_non_stream_answer_with_usage(client: httpx.AsyncClient, path: str, body: Any, text_of: Any) -> None:
    response = await client.post(path, json=body)

    assert response.headers["content-type"] == "application/json"
    answer = response.json()
    assert answer["id"].startswith("chatcmpl-" if path == CHAT else "cmpl-")
    assert answer["object"] == ("chat.completion" if path == CHAT else "text_completion")
    assert text_of(answer["choices"][0]) == "tok0 tok1"
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


async def test_errors_in_vllm_shape(client: httpx.AsyncClient) -> None:
    not_json = await client.post(CHAT, content=b"{nope", headers={"content-type": "application/json"})
    assert not_json.status_code == 400
    assert not_json.json()["error"] | {"message": ""} == {
        "message": "",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }

    forced = await client.post(CHAT, json={"messages": MESSAGES, "fake_status": 503})
    assert forced.status_code == 503 and forced.json()["error"]["code"] == 503

    wrong_model = await client.post(CHAT, json={"messages": MESSAGES, "model": "other"})
    assert wrong_model.status_code == 404 and wrong_model.json()["error"]["type"] == "NotFoundError"


async def test_request_recorded_under_request_id(engine: FakeEngineControl, client: httpx.AsyncClient) -> None:
    before = time.time()
    await client.post(CHAT, json={"messages": MESSAGES, "max_tokens": 1}, headers={"X-Request-Id": "rid-1"})

    (record,) = await engine.arequests()
    assert record == await engine.arequest("rid-1")
    assert record["path"] == CHAT and record["headers"]["x-request-id"] == "rid-1"
    assert record["body"] == {"messages": MESSAGES, "max_tokens": 1}
    assert record["completed"] and not record["disconnected"] and record["status"] == 200
    assert before <= record["received_at"] <= record["completed_at"] <= time.time()


async def test_stream_closed_midway_is_recorded_as_disconnect(
    engine: FakeEngineControl, client: httpx.AsyncClient
) -> None:
    body = {"messages": MESSAGES, "max_tokens": 200, "stream": True, "fake_token_delay": 0.02}
    async with client.stream("POST", CHAT, json=body) as response:
        lines = response.aiter_lines()
        while "tok2" not in await anext(lines):
            pass
        assert (await engine.astats())["active_streams"] == 1

    (record,) = await async_wait_until(lambda: _where(engine, "disconnected"))
    assert not record["completed"] and 3 <= record["tokens_sent"] < 200
    stats = await engine.astats()
    assert (stats["disconnects"], stats["active_streams"]) == (1, 0)


async def test_non_stream_abandoned_during_prefill_is_recorded(engine: FakeEngineControl) -> None:
    # A prefill longer than the test may run: only a disconnect seen during it can be recorded.
    async with httpx.AsyncClient(base_url=engine.base_url, timeout=0.3) as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.post(CHAT, json={"messages": MESSAGES, "fake_prefill_delay": 3600})

    (record,) = await async_wait_until(lambda: _where(engine, "disconnected"), within=10)
    assert not record["completed"] and record["status"] is None


async def test_die_after_closes_stream_without_done(engine: FakeEngineControl, client: httpx.AsyncClient) -> None:
    seen: list[str] = []
    body = {"messages": MESSAGES, "max_tokens": 10, "stream": True, "fake_die_after": 2}
    with pytest.raises(httpx.RemoteProtocolError):
        async with client.stream("POST", CHAT, json=body) as response:
            async for line in response.aiter_lines():
                if line:
                    seen.append(line)
    assert len(seen) == 3 and "[DONE]" not in seen[-1]

    with pytest.raises(httpx.RemoteProtocolError):
        await client.post(CHAT, json={"messages": MESSAGES, "fake_die_after": 0})

    records = await engine.arequests()
    assert [(r["aborted"], r["tokens_sent"], r["completed"]) for r in records] == [(True, 2, False), (True, 0, False)]


async def test_health_toggle(engine: FakeEngineControl, client: httpx.AsyncClient) -> None:
    await engine.aset_health(503)
    assert (await client.get("/health")).status_code == 503

    await engine.aset_health(200, hang=True)
    with pytest.raises(httpx.ReadTimeout):
        await client.get("/health", timeout=0.2)

    await engine.areset()
    assert (await client.get("/health")).status_code == 200
    assert (await engine.astats())["health_checks"] == 1


def test_server_process_reports_early_exit_with_log_tail() -> None:
    argv = [sys.executable, "-c", "import sys; print('model load failed'); sys.exit(3)"]
    with pytest.raises(ServerProcessError, match="model load failed"):
        ServerProcess(argv, ready_url="http://127.0.0.1:9/health").start()


def test_stop_escalates_to_sigkill_when_sigterm_is_ignored() -> None:
    process = run_fake_engine(ignore_sigterm=True)
    process.stop_timeout = 0.3
    assert process.stop() == -signal.SIGKILL
    assert "ignoring SIGTERM" in process.log_text()


async def _where(engine: FakeEngineControl, flag: str) -> list[dict[str, Any]]:
    return [record for record in await engine.arequests() if record[flag]]
