"""The Responses API and Anthropic's Messages API through real gateway processes, real Redis and the fake engine:
event framing kept, usage counted, heartbeats, a dying or frozen engine ending the stream with the event each SDK
raises on, Anthropic's error envelope, bounds, stored responses (`store: false`, ownership, what reading them costs
the key), the access log's API. Gateway `on` has the default settings; `off` the nemotron-nano-9b-v2 preset (a
`/think` line). The stored state itself is tested in test_stored_responses.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import orjson
import pytest
import redis

from gateway.settings import DEFAULT_SYSTEM_MESSAGE
from tests.procs import REPO_ROOT, FakeEngineControl, ServerProcess, run_fake_engine, run_gateway, wait_until

pytestmark = pytest.mark.timeout(90)

MODEL = "nemotron-test"
PEPPER = "apis-test-pepper"
BASE_ENV = {
    "NEMOTRON_AUTH__SECRET": PEPPER,
    "NEMOTRON_RELAY__PROBE_INTERVAL": "0.2",
    "NEMOTRON_RELAY__HEARTBEAT_INTERVAL": "0.3",
    "NEMOTRON_RELAY__CHUNK_TIMEOUT": "2",
    "NEMOTRON_MAX_MESSAGES": "50",
    "NEMOTRON_MAX_LIST_ENTRIES": "60",
}
HI = [{"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def apis_engine() -> Iterator[FakeEngineControl]:
    with run_fake_engine() as process:
        yield FakeEngineControl(process)


@pytest.fixture(scope="module")
def gateways(apis_engine: FakeEngineControl, redis_url: str) -> Iterator[dict[str, ServerProcess]]:
    on = dict(BASE_ENV)
    off = {**BASE_ENV, "NEMOTRON_ENGINE__PRESET": "nemotron-nano-9b-v2"}
    with (
        run_gateway(apis_engine.base_url, redis_url, env=on) as on_proc,
        run_gateway(apis_engine.base_url, redis_url, env=off) as off_proc,
    ):
        yield {"on": on_proc, "off": off_proc}


@pytest.fixture
def urls(gateways: dict[str, ServerProcess], apis_engine: FakeEngineControl) -> dict[str, str]:
    apis_engine.reset()
    return {name: f"http://127.0.0.1:{proc.port}" for name, proc in gateways.items()}


def keys_cli(redis_url: str, verb: str, *args: str) -> str:
    """`keys <verb> <args>`: its last output line (a new key's secret for create and rotate)."""
    out = keys_output(redis_url, verb, *args)
    return out.splitlines()[-1] if out else ""


def keys_output(redis_url: str, verb: str, *args: str) -> str:
    """`keys <verb> <args>`: all it printed."""
    argv = [sys.executable, "-m", "gateway", "keys", verb, *args, "--redis-url", redis_url]
    done = subprocess.run(
        argv,
        cwd=REPO_ROOT,
        env={**os.environ, "NEMOTRON_AUTH__SECRET": PEPPER},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout.strip()


def new_key(redis_url: str, *flags: str, name: str | None = None) -> str:
    return keys_cli(redis_url, "create", "--name", name or f"apis-{uuid.uuid4().hex[:8]}", *flags)


@pytest.fixture(scope="module")
def key(redis_url: str) -> str:
    return new_key(redis_url)


def oai(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=20)


def claude(url: str, key: str) -> anthropic.Anthropic:
    # The key as `x-api-key`, as Anthropic's API wants it (this SDK's `api_key` is sent as a Bearer token).
    return anthropic.Anthropic(base_url=url, default_headers={"x-api-key": key}, max_retries=0, timeout=20)


def blocks(raw: bytes) -> list[bytes]:
    return [b for b in raw.split(b"\n\n") if b.strip()]


def post_raw(url: str, path: str, key: str, body: dict[str, Any], **headers: str) -> bytes:
    with httpx.stream("POST", f"{url}{path}", json=body, headers={"x-api-key": key, **headers}, timeout=20) as response:
        assert response.status_code == 200, response.read()
        return b"".join(response.iter_raw())


def metric(url: str, name: str, labels: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith(f"{name}{{{labels}}} "):
            return float(line.split()[-1])
    return 0.0


# --- streams: framing, usage, heartbeats, failures ---


def test_a_responses_stream_keeps_its_event_framing_and_its_usage_is_counted(urls: dict[str, str], key: str) -> None:
    url = urls["on"]
    before = {
        k: metric(url, "nemotron_gateway_api_tokens_total", f'api="responses",kind="{k}"')
        for k in ("prompt", "completion", "reasoning")
    }
    raw = post_raw(
        url, "/v1/responses", key, {"model": MODEL, "input": "one two three", "stream": True, "max_output_tokens": 6}
    )
    events = blocks(raw)
    assert [e.split(b"\n")[0] for e in events] == [
        b"event: response.created",
        *[b"event: response.output_text.delta"] * 6,
        b"event: response.completed",
    ]
    assert b"[DONE]" not in raw
    with oai(url, key) as sdk:
        final = list(sdk.responses.create(model=MODEL, input="one two three", stream=True, max_output_tokens=4))[-1]
    assert final.type == "response.completed"
    after = {k: metric(url, "nemotron_gateway_api_tokens_total", f'api="responses",kind="{k}"') for k in before}
    # Prompt: three words and the default system message's words, twice; output 6 + 4, reasoning half of it.
    prompt = 3 + len(DEFAULT_SYSTEM_MESSAGE.split())
    assert after["prompt"] - before["prompt"] == 2 * prompt
    assert after["completion"] - before["completion"] == 10
    assert after["reasoning"] - before["reasoning"] == 5
    assert metric(url, "nemotron_gateway_api_requests_total", 'api="responses",status="200"') >= 2


def test_a_messages_stream_with_a_silent_engine_gets_heartbeats_and_its_usage_counted(
    urls: dict[str, str], key: str, apis_engine: FakeEngineControl
) -> None:
    url = urls["on"]
    before = metric(url, "nemotron_gateway_api_tokens_total", 'api="messages",kind="completion"')
    body = {"model": MODEL, "max_tokens": 3, "messages": HI, "stream": True, "fake_prefill_delay": 1.0}
    raw = post_raw(url, "/v1/messages", key, body, **{"anthropic-version": "2023-06-01"})
    assert raw.startswith(b": keep-alive\n\n") and raw.count(b": keep-alive") >= 2
    assert raw.endswith(b'event: message_stop\ndata: {"type":"message_stop"}\n\n')
    with claude(url, key) as sdk:
        with sdk.messages.stream(model=MODEL, max_tokens=5, messages=HI) as stream:  # type: ignore[arg-type]
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
    assert text == "tok0 tok1 tok2 tok3 tok4" and final.usage.output_tokens == 5
    after = metric(url, "nemotron_gateway_api_tokens_total", 'api="messages",kind="completion"')
    assert after - before == 8
    # The Anthropic SDK's headers reach the engine; the client's key does not.
    sent = [r for r in apis_engine.requests() if r["path"] == "/v1/messages"][-1]["headers"]
    assert sent["anthropic-version"] and "x-api-key" not in sent and key not in str(sent)


def test_an_engine_dying_mid_stream_ends_each_stream_with_the_error_event_its_sdk_raises(
    urls: dict[str, str], key: str
) -> None:
    url = urls["on"]
    raw = post_raw(
        url,
        "/v1/responses",
        key,
        {"model": MODEL, "input": "Hi", "stream": True, "max_output_tokens": 20, "fake_die_after": 3},
    )
    name, data = blocks(raw)[-1].split(b"\n")
    event = orjson.loads(data[6:])
    assert name == b"event: error" and event["type"] == "error" and event["code"] == "engine_unavailable"
    assert "incomplete" in event["message"]
    with oai(url, key) as sdk, pytest.raises(openai.APIError, match="incomplete"):
        list(
            sdk.responses.create(
                model=MODEL, input="Hi", stream=True, max_output_tokens=20, extra_body={"fake_die_after": 3}
            )
        )
    raw = post_raw(
        url,
        "/v1/messages",
        key,
        {"model": MODEL, "messages": HI, "stream": True, "max_tokens": 20, "fake_die_after": 3},
    )
    name, data = blocks(raw)[-1].split(b"\n")
    assert name == b"event: error"
    assert orjson.loads(data[6:])["error"]["type"] == "overloaded_error"
    with claude(url, key) as sdk, pytest.raises(anthropic.APIStatusError, match="incomplete"):
        with sdk.messages.stream(model=MODEL, max_tokens=20, messages=HI, extra_body={"fake_die_after": 3}) as stream:  # type: ignore[arg-type]
            list(stream)


def test_a_frozen_engine_ends_responses_and_messages_streams_with_a_timeout_event(
    urls: dict[str, str], key: str
) -> None:
    url = urls["on"]
    raw = post_raw(
        url,
        "/v1/responses",
        key,
        {"model": MODEL, "input": "Hi", "stream": True, "max_output_tokens": 3, "fake_token_delay": 10},
    )
    assert orjson.loads(blocks(raw)[-1].split(b"\n")[1][6:])["code"] == "engine_timeout"
    raw = post_raw(
        url,
        "/v1/messages",
        key,
        {"model": MODEL, "messages": HI, "stream": True, "max_tokens": 3, "fake_token_delay": 10},
    )
    assert orjson.loads(blocks(raw)[-1].split(b"\n")[1][6:])["error"]["type"] == "timeout_error"


def test_a_client_leaving_a_responses_stream_closes_the_engine_request(
    urls: dict[str, str], key: str, apis_engine: FakeEngineControl
) -> None:
    body = {"model": MODEL, "input": "Hi", "stream": True, "max_output_tokens": 200, "fake_token_delay": 0.05}
    with httpx.stream(
        "POST", f"{urls['on']}/v1/responses", json=body, headers={"authorization": f"Bearer {key}"}, timeout=20
    ) as response:
        for index, _ in enumerate(response.iter_lines()):
            if index == 6:
                break
    wait_until(lambda: apis_engine.requests()[-1]["disconnected"], timeout=10, message="engine request still open")
    assert apis_engine.requests()[-1]["tokens_sent"] < 200


# --- errors in each API's envelope ---


def test_anthropic_routes_answer_in_anthropics_envelope_and_the_sdk_raises_its_own_classes(
    urls: dict[str, str], key: str, redis_url: str
) -> None:
    url = urls["on"]
    with claude(url, "sk-" + "A" * 43) as sdk, pytest.raises(anthropic.AuthenticationError) as wrong:
        sdk.messages.create(model=MODEL, max_tokens=4, messages=HI)  # type: ignore[arg-type]
    assert wrong.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": wrong.value.body["error"]["message"]},
    }  # type: ignore[index]
    with claude(url, key) as sdk:
        with pytest.raises(anthropic.BadRequestError) as bad:
            sdk.messages.create(model=MODEL, max_tokens="4", messages=HI)  # type: ignore[arg-type]
        assert "max_tokens" in bad.value.body["error"]["message"]  # type: ignore[index]
        with pytest.raises(anthropic.BadRequestError, match=r"messages\[0\]\.role"):
            sdk.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "system", "content": "x"}])  # type: ignore[list-item]
        with pytest.raises(anthropic.NotFoundError):
            sdk.messages.create(model="gpt-4", max_tokens=4, messages=HI)  # type: ignore[arg-type]
    limited = new_key(redis_url, "--rpm", "1")
    with claude(url, limited) as sdk:
        sdk.messages.create(model=MODEL, max_tokens=2, messages=HI)  # type: ignore[arg-type]
        with pytest.raises(anthropic.RateLimitError) as over:
            sdk.messages.create(model=MODEL, max_tokens=2, messages=HI)  # type: ignore[arg-type]
    assert over.value.response.headers["retry-after"] and over.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]
    counted = httpx.post(
        f"{url}/v1/messages/count_tokens",
        json={"model": MODEL, "messages": HI},
        headers={"authorization": f"Bearer {key}"},
    )
    assert counted.status_code == 200 and counted.json()["input_tokens"] == 2 + len(DEFAULT_SYSTEM_MESSAGE.split())


def test_responses_validation_names_the_field_in_openais_envelope(urls: dict[str, str], key: str) -> None:
    with oai(urls["on"], key) as sdk:
        for body, param in (
            ({"input": "Hi", "max_output_tokens": "5"}, "max_output_tokens"),
            ({"input": 5}, "input"),
            ({"input": [{"role": "User", "content": "x"}]}, "input[0].role"),
            ({"input": "Hi", "stream": "yes"}, "stream"),
            ({"input": "Hi", "reasoning": {"effort": "huge"}}, "reasoning.effort"),
            ({"input": [{"role": "user", "content": "x"}] * 51}, "input"),
            # Counted exactly once parsed (these parts carry no `"type"` to count in the raw body).
            ({"input": [{"role": "user", "content": [{"text": "x"}] * 61}]}, "input"),
        ):
            with pytest.raises(openai.BadRequestError) as bad:
                sdk.post("/responses", body={"model": MODEL, **body}, cast_to=httpx.Response)
            assert bad.value.body["param"] == param, bad.value.body  # type: ignore[index]
    with claude(urls["on"], key) as sdk, pytest.raises(anthropic.BadRequestError, match="list entries"):
        sdk.messages.create(
            model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [{"type": "text", "text": "x"}] * 61}]
        )  # type: ignore[list-item]


def test_openai_sdk_resources_not_served_are_a_clear_404(urls: dict[str, str], key: str) -> None:
    with oai(urls["on"], key) as sdk:
        calls = [
            lambda: sdk.embeddings.create(model=MODEL, input="x"),
            lambda: sdk.files.list(),
            lambda: sdk.batches.list(),
            lambda: sdk.images.generate(prompt="x"),
            lambda: sdk.moderations.create(input="x"),
            lambda: sdk.audio.speech.create(model=MODEL, voice="alloy", input="x"),
            lambda: sdk.fine_tuning.jobs.list(),
            lambda: sdk.vector_stores.list(),
        ]
        for call in calls:
            with pytest.raises(openai.NotFoundError) as missing:
                call()
            assert "is not served here" in missing.value.body["message"]  # type: ignore[index]


# --- policy: instructions, reasoning ---


def test_instructions_carry_the_default_system_message_and_the_reasoning_switch(
    urls: dict[str, str], key: str, apis_engine: FakeEngineControl
) -> None:
    with oai(urls["off"], key) as sdk:
        sdk.responses.create(model=MODEL, input="Hi", reasoning={"effort": "none"}, max_output_tokens=2)
        sent = apis_engine.requests()[-1]["body"]
        assert sent["instructions"] == f"{DEFAULT_SYSTEM_MESSAGE}\n/no_think"
        assert sent["chat_template_kwargs"] == {"enable_thinking": False}
        sdk.responses.create(
            model=MODEL, input="Hi", instructions="Be brief.", reasoning={"effort": "high"}, max_output_tokens=2
        )
        sent = apis_engine.requests()[-1]["body"]
        assert sent["instructions"] == "Be brief.\n/think" and sent["chat_template_kwargs"] == {"enable_thinking": True}


# --- stored responses ---


def test_a_response_with_store_false_is_not_kept_and_background_needs_the_store(urls: dict[str, str], key: str) -> None:
    with oai(urls["on"], key) as sdk:
        unkept = sdk.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
        assert unkept.store is False and unkept.output_text == "tok0 tok1"
        with pytest.raises(openai.NotFoundError, match="No response found"):
            sdk.responses.retrieve(unkept.id)
        with pytest.raises(openai.NotFoundError) as continued:
            sdk.responses.create(model=MODEL, input="Go on", previous_response_id=unkept.id, max_output_tokens=2)
        assert continued.value.body["param"] == "previous_response_id"  # type: ignore[index]
        with pytest.raises(openai.BadRequestError, match="background") as refused:
            sdk.responses.create(model=MODEL, input="Hi", max_output_tokens=2, background=True, store=False)
        assert refused.value.body["param"] == "store"  # type: ignore[index]


def test_a_stored_response_belongs_to_the_key_that_created_it(urls: dict[str, str], key: str, redis_url: str) -> None:
    other = new_key(redis_url)
    with oai(urls["on"], key) as sdk:
        made = sdk.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
        assert made.store is True and sdk.responses.retrieve(made.id).id == made.id
        streamed = list(sdk.responses.create(model=MODEL, input="Hi", max_output_tokens=2, stream=True))[-1]
        assert sdk.responses.retrieve(streamed.response.id).id == streamed.response.id  # type: ignore[union-attr]
        sdk.responses.create(model=MODEL, input="Go on", previous_response_id=made.id, max_output_tokens=2)
    with oai(urls["on"], other) as sdk:
        with pytest.raises(openai.NotFoundError, match="No response found"):
            sdk.responses.retrieve(made.id)
        with pytest.raises(openai.NotFoundError):
            sdk.responses.cancel(made.id)
        with pytest.raises(openai.NotFoundError):
            sdk.responses.create(model=MODEL, input="Go on", previous_response_id=made.id, max_output_tokens=2)
    client = redis.Redis.from_url(redis_url)
    try:
        record = f"nemotron:resp:{made.id}"
        # The key's record id (`name@created_at`): kept by a rotation, never its secret.
        owner = client.hget(record, "owner")
        assert owner is not None and re.fullmatch(r"apis-[0-9a-f]{8}@\d{4}-\d\d-\d\dT[0-9:.+]+", owner.decode())
        assert key not in str(client.hgetall(record))
        assert 0 < client.ttl(record) <= 30 * 86400
    finally:
        client.close()


def test_the_access_log_and_route_labels_name_the_api(
    urls: dict[str, str], key: str, gateways: dict[str, ServerProcess]
) -> None:
    with oai(urls["on"], key) as sdk:
        sdk.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
        with pytest.raises(openai.NotFoundError):
            sdk.responses.retrieve("resp_missing")
    wait_until(lambda: "api=responses" in gateways["on"].log_text(), timeout=5)
    assert metric(urls["on"], "nemotron_gateway_requests_total", 'route="/v1/responses/{id}",status="404"') >= 1


def test_the_gpu_checker_script_reports_all_four_calls(urls: dict[str, str], key: str) -> None:
    done = subprocess.run(
        [sys.executable, "tests/gpu/apis.py", "--url", urls["on"], "--key", key, "--model", MODEL],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = orjson.loads(done.stdout)
    assert report["responses_stream"]["events"][-1] == "response.completed"
    assert report["messages_stream"]["events"][0] == "message_start"
    assert report["messages"]["usage"]["output_tokens"] == 32 and report["responses"]["text_length"] > 0


# --- accounting a client cannot end or dodge ---

# What vLLM echoes of a Responses request in its first events, planted to look like the end and a usage.
PLANTED = {
    "metadata": {"type": "response.completed"},
    "tools": [
        {
            "type": "function",
            "name": "report",
            "parameters": {"type": "object", "properties": {"usage": {"type": "object"}}},
        }
    ],
}


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def test_planted_metadata_neither_ends_a_streams_accounting_nor_frees_its_slot(
    urls: dict[str, str], redis_url: str
) -> None:
    url, key = urls["on"], new_key(redis_url, "--max-concurrency", "1")
    before = metric(url, "nemotron_gateway_api_tokens_total", 'api="responses",kind="completion"')
    body = {"model": MODEL, "input": "Hi", "stream": True, "max_output_tokens": 8, "fake_token_delay": 0.2, **PLANTED}
    with httpx.stream("POST", f"{url}/v1/responses", json=body, headers=bearer(key), timeout=20) as first:
        lines = first.iter_lines()
        assert next(lines) == "event: response.created"
        created = orjson.loads(next(lines)[6:])
        assert created["response"]["metadata"] == PLANTED["metadata"]  # the engine echoed it
        # The stream still holds the key's one slot: a second request is refused.
        second = httpx.post(f"{url}/v1/responses", json={**body, "stream": False}, headers=bearer(key), timeout=20)
        assert second.status_code == 429, second.text
        assert "too many requests in flight" in second.json()["error"]["message"]
        rest = list(lines)
    assert "event: response.completed" in rest
    after = metric(url, "nemotron_gateway_api_tokens_total", 'api="responses",kind="completion"')
    assert after - before == 8  # the engine's usage, not the up-front estimate
    with oai(url, key) as sdk:  # its owner was written once it ended
        assert sdk.responses.retrieve(created["response"]["id"]).id == created["response"]["id"]


def test_reading_or_cancelling_a_stored_response_counts_against_the_keys_limits(
    urls: dict[str, str], redis_url: str
) -> None:
    url, key = urls["on"], new_key(redis_url, "--rpm", "4", "--max-concurrency", "2")
    # A background run holds one of the key's two slots while it is made (a token every 0.2 s for 4 s).
    made = httpx.post(
        f"{url}/v1/responses",
        json={"model": MODEL, "input": "Hi", "background": True, "max_output_tokens": 20, "fake_token_delay": 0.2},
        headers=bearer(key),
        timeout=20,
    ).json()
    path = f"{url}/v1/responses/{made['id']}"
    with httpx.stream("GET", f"{path}?stream=true", headers=bearer(key), timeout=20) as replay:
        assert replay.headers["x-ratelimit-remaining-requests"] == "2"
        lines = replay.iter_lines()
        assert next(lines) == "event: response.created"
        # A followed stream holds the other slot until it ends.
        busy = httpx.get(path, headers=bearer(key), timeout=20)
        assert busy.status_code == 429 and "too many requests in flight" in busy.json()["error"]["message"]
        assert "event: response.completed" in list(lines)
    cancelled = httpx.post(f"{path}/cancel", headers=bearer(key), timeout=20)
    assert cancelled.headers["x-ratelimit-remaining-requests"] == "1"
    read = httpx.get(path, headers=bearer(key), timeout=20)
    assert read.status_code == 200 and read.headers["x-ratelimit-remaining-requests"] == "0"
    over = httpx.get(path, headers=bearer(key), timeout=20)
    assert over.status_code == 429 and "requests per" in over.json()["error"]["message"]


def test_a_response_made_without_background_is_not_streamed_again(urls: dict[str, str], key: str) -> None:
    with oai(urls["on"], key) as sdk:
        made = sdk.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    answer = httpx.get(f"{urls['on']}/v1/responses/{made.id}?stream=true", headers=bearer(key), timeout=20)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "stream", answer.text


def test_a_key_created_again_under_a_deleted_keys_name_cannot_read_its_responses(
    urls: dict[str, str], redis_url: str
) -> None:
    name = f"apis-{uuid.uuid4().hex[:8]}"
    first = new_key(redis_url, name=name)
    with oai(urls["on"], first) as sdk:
        made = sdk.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    rotated = keys_cli(redis_url, "rotate", name)
    with oai(urls["on"], rotated) as sdk:  # a new secret for the same key: its responses stay its own
        assert sdk.responses.retrieve(made.id).id == made.id
    keys_cli(redis_url, "delete", name)
    again = new_key(redis_url, name=name)
    with oai(urls["on"], again) as sdk, pytest.raises(openai.NotFoundError, match="No response found"):
        sdk.responses.retrieve(made.id)


@pytest.fixture(scope="module")
def queue_bound(apis_engine: FakeEngineControl, redis_url: str) -> Iterator[str]:
    # Two places in the engine's queue, and a scrape of its gauges at start only: what the gateways admit meanwhile
    # counts as waiting until the next scrape.
    env = {
        **BASE_ENV,
        "NEMOTRON_RELAY__PROBE_INTERVAL": "60",
        "NEMOTRON_ADMISSION__MAX_WAITING": "2",
        "NEMOTRON_ADMISSION__ENGINE_ID": uuid.uuid4().hex,
    }
    with run_gateway(apis_engine.base_url, redis_url, env=env) as proc:
        url = f"http://127.0.0.1:{proc.port}"
        wait_until(lambda: 'figure="waiting"' in httpx.get(f"{url}/metrics", timeout=5).text, timeout=10)
        yield url


def test_counting_tokens_takes_no_place_in_the_engines_queue_and_charges_nothing(
    queue_bound: str, redis_url: str
) -> None:
    counter, writer = new_key(redis_url, "--daily-tokens", "1000"), new_key(redis_url)
    with claude(queue_bound, counter) as sdk:
        for _ in range(3):
            counted = sdk.messages.count_tokens(model=MODEL, messages=HI)  # type: ignore[arg-type]
            assert counted.input_tokens > 0
    used = httpx.post(
        f"{queue_bound}/v1/messages/count_tokens",
        json={"model": MODEL, "messages": HI},
        headers=bearer(counter),
        timeout=20,
    )
    assert used.headers["x-budget-remaining-tokens-day"] == "1000"  # nothing charged for it
    with claude(queue_bound, writer) as sdk:  # another key's generation is not refused for them
        assert sdk.messages.create(model=MODEL, max_tokens=2, messages=HI).usage.output_tokens == 2  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("query", "param"),
    [
        ("stream=yes", "stream"),
        ("stream=true&starting_after=%D9%A1%D9%A2", "starting_after"),  # Arabic-Indic digits pass isdigit()
        ("stream=true&starting_after=-1", "starting_after"),
        ("starting_after=1%0D%0AX-Injected:%201", "starting_after"),
    ],
    ids=["stream-word", "non-ascii-digits", "negative", "crlf"],
)
def test_a_stored_responses_query_values_of_the_wrong_kind_are_400s_naming_them(
    urls: dict[str, str], redis_url: str, query: str, param: str
) -> None:
    key = new_key(redis_url)
    with oai(urls["on"], key) as sdk:
        made = sdk.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    answer = httpx.get(f"{urls['on']}/v1/responses/{made.id}?{query}", headers=bearer(key), timeout=20)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
