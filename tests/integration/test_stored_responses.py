"""The Responses API's stored state kept by the gateway in Redis, through real gateways, a real Redis and the fake
engine (which, as the gateway runs vLLM, has no store of its own): a chain by `previous_response_id` sent as one
stateless request, ownership by the key's record, broken chains, input_items paging, background responses (polled,
streamed, replayed, cancelled, resumed after their gateway stopped or died), the per-key bounds and TTL, and Redis
down. Gateway `main` has the default bounds; `bounded` small ones (3 responses, 8000 bytes, chains of 2, 600 s).
"""

from __future__ import annotations

import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
import redis

from tests.integration.test_apis import BASE_ENV, MODEL, bearer, keys_cli, keys_output, metric, new_key, oai
from tests.integration.test_redis_faults import PrivateRedis
from tests.procs import FakeEngineControl, run_gateway, wait_until

pytestmark = pytest.mark.timeout(90)

# Slow background runs send a token every few tenths of a second: well inside the stall check.
ENV = {**BASE_ENV, "NEMOTRON_RELAY__CHUNK_TIMEOUT": "5"}
BOUNDED_ENV = {
    **ENV,
    "NEMOTRON_RESPONSES__MAX_PER_KEY": "3",
    "NEMOTRON_RESPONSES__MAX_BYTES_PER_KEY": "8000",
    "NEMOTRON_RESPONSES__MAX_CHAIN": "2",
    "NEMOTRON_RESPONSES__STORE_TTL": "600",
}
RECORD = "nemotron:resp:"
TOOL = {"type": "function", "name": "weather", "parameters": {"type": "object", "properties": {}}}
# Generous: only there to stop a hung test.
SETTLED = 30.0


@pytest.fixture(scope="module")
def gateways(fake_engine: FakeEngineControl, redis_url: str) -> Iterator[dict[str, str]]:
    with (
        run_gateway(fake_engine.base_url, redis_url, env=ENV) as main,
        run_gateway(fake_engine.base_url, redis_url, env=BOUNDED_ENV) as bounded,
    ):
        yield {"main": f"http://127.0.0.1:{main.port}", "bounded": f"http://127.0.0.1:{bounded.port}"}


@pytest.fixture
def url(gateways: dict[str, str], engine: FakeEngineControl) -> str:
    return gateways["main"]


@pytest.fixture
def key(redis_url: str) -> str:
    return new_key(redis_url)


@pytest.fixture
def db(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, socket_timeout=5.0)
    try:
        yield client
    finally:
        client.close()


def engine_runs(engine: FakeEngineControl, response_id: str) -> list[dict[str, Any]]:
    """The engine requests a background response's runs made, oldest first."""
    return [r for r in engine.requests() if (r["request_id"] or "").startswith(f"background-{response_id}-")]


def settled(sdk: openai.OpenAI, response_id: str) -> Any:
    """The response once it is no longer queued or in progress."""
    return wait_until(
        lambda: (found := sdk.responses.retrieve(response_id)).status not in ("queued", "in_progress") and found,
        timeout=SETTLED,
        interval=0.2,
        message=f"{response_id} never finished",
    )


def error_of(answer: httpx.Response, status: int) -> dict[str, Any]:
    """The OpenAI error object of `answer`, which must have `status`."""
    assert answer.status_code == status, answer.text
    body = answer.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"]), body
    error: dict[str, Any] = body["error"]
    return error


def slow(tokens: int, delay: float = 0.25) -> dict[str, Any]:
    return {"max_output_tokens": tokens, "extra_body": {"fake_token_delay": delay}}


# --- a conversation by previous_response_id ---


def test_a_chain_with_a_function_call_reaches_the_engine_as_one_stateless_request_per_turn(
    url: str, key: str, engine: FakeEngineControl
) -> None:
    question = {"role": "user", "content": "What is the weather in Paris?"}
    with oai(url, key) as sdk:
        first = sdk.responses.create(
            model=MODEL,
            input=[question],  # type: ignore[list-item]
            tools=[TOOL],  # type: ignore[list-item]
            max_output_tokens=4,
            extra_body={"fake_function_call": {"name": "weather", "arguments": '{"city":"Paris"}'}},
        )
        call = first.output[0]
        assert call.type == "function_call" and call.name == "weather"
        result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky":"clear"}'}
        second = sdk.responses.create(
            model=MODEL,
            input=[result],  # type: ignore[list-item]
            previous_response_id=first.id,
            max_output_tokens=3,
        )
        follow_up = {"role": "user", "content": "And tomorrow?"}
        third = sdk.responses.create(
            model=MODEL,
            input=[follow_up],  # type: ignore[list-item]
            previous_response_id=second.id,
            max_output_tokens=2,
        )
    assert (second.previous_response_id, third.previous_response_id) == (first.id, second.id)
    assert second.store is True and third.store is True
    assert third.output_text == "tok0 tok1"
    sent = [r["body"] for r in engine.requests() if r["path"] == "/v1/responses"]
    assert len(sent) == 3
    for body in sent:
        assert "previous_response_id" not in body and "background" not in body
    call_item = first.output[0].model_dump(exclude_none=True)
    answer_item = second.output[0].model_dump(exclude_none=True)

    def items(body: dict[str, Any]) -> list[dict[str, Any]]:
        return [{k: v for k, v in item.items() if v is not None} for item in body["input"]]

    assert items(sent[1]) == [question, call_item, result]
    assert items(sent[2]) == [question, call_item, result, answer_item, follow_up]


# --- ownership, deletion, ids ---


def test_another_keys_deleted_unknown_or_malformed_ids_are_404s_everywhere(
    url: str, key: str, redis_url: str, db: redis.Redis
) -> None:
    other = new_key(redis_url)
    with oai(url, key) as sdk:
        made = sdk.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    owner = db.hget(RECORD + made.id, "owner")
    assert owner is not None and owner.decode().startswith("apis-") and "@" in owner.decode()

    def everywhere(secret: str, response_id: str) -> None:
        with oai(url, secret) as sdk:
            for call in (
                lambda: sdk.responses.retrieve(response_id),
                lambda: sdk.responses.delete(response_id),
                lambda: sdk.responses.input_items.list(response_id),
                lambda: sdk.responses.cancel(response_id),
            ):
                with pytest.raises(openai.NotFoundError, match="No response found"):
                    call()
            with pytest.raises(openai.NotFoundError) as continued:
                sdk.responses.create(model=MODEL, input="Go on", previous_response_id=response_id, max_output_tokens=2)
            assert continued.value.body["param"] == "previous_response_id"  # type: ignore[index]

    everywhere(other, made.id)
    with oai(url, key) as sdk:
        assert sdk.responses.retrieve(made.id).id == made.id  # the other key's calls changed nothing
        answer = httpx.delete(f"{url}/v1/responses/{made.id}", headers=bearer(key), timeout=20)
        assert answer.json() == {"id": made.id, "object": "response", "deleted": True}
    everywhere(key, made.id)
    assert not db.exists(RECORD + made.id)
    everywhere(key, "resp_" + uuid.uuid4().hex)
    # A record planted under ids that are not ids, owned by this key: found only if the id reached Redis.
    for bad in ("resp_a.b", "resp_" + "a" * 200, "resp_a%20b"):
        planted = bad.replace("%20", " ")
        db.hset(RECORD + planted, mapping={"owner": owner, "response": orjson.dumps({"id": planted}), "input": "[]"})
        answer = httpx.get(f"{url}/v1/responses/{bad}", headers=bearer(key), timeout=20)
        assert error_of(answer, 404)["type"] == "invalid_request_error"
        db.delete(RECORD + planted)


# --- chains that cannot be continued ---


def test_a_loop_a_chain_over_max_chain_or_an_unfinished_response_cannot_be_continued(
    gateways: dict[str, str], url: str, key: str, db: redis.Redis
) -> None:
    with oai(url, key) as sdk:
        first = sdk.responses.create(model=MODEL, input="one", max_output_tokens=2)
        second = sdk.responses.create(model=MODEL, input="two", previous_response_id=first.id, max_output_tokens=2)
        db.hset(RECORD + first.id, "previous", second.id)
        with pytest.raises(openai.BadRequestError, match="loops") as looped:
            sdk.responses.create(model=MODEL, input="three", previous_response_id=second.id, max_output_tokens=2)
        assert looped.value.body["param"] == "previous_response_id"  # type: ignore[index]
        running = sdk.responses.create(model=MODEL, input="Hi", background=True, **slow(40))
        with pytest.raises(openai.BadRequestError, match=r"queued|in_progress") as unfinished:
            sdk.responses.create(model=MODEL, input="more", previous_response_id=running.id, max_output_tokens=2)
        assert unfinished.value.body["param"] == "previous_response_id"  # type: ignore[index]
        sdk.responses.delete(running.id)
    with oai(gateways["bounded"], key) as sdk:  # chains of at most 2 responses
        one = sdk.responses.create(model=MODEL, input="one", max_output_tokens=2)
        two = sdk.responses.create(model=MODEL, input="two", previous_response_id=one.id, max_output_tokens=2)
        three = sdk.responses.create(model=MODEL, input="three", previous_response_id=two.id, max_output_tokens=2)
        with pytest.raises(openai.BadRequestError, match="more than 2 responses") as long:
            sdk.responses.create(model=MODEL, input="four", previous_response_id=three.id, max_output_tokens=2)
        assert long.value.body["param"] == "previous_response_id"  # type: ignore[index]


# --- input_items ---


def test_input_items_are_paged_as_openai_pages_them(url: str, key: str) -> None:
    said = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(5)]
    with oai(url, key) as sdk:
        made = sdk.responses.create(model=MODEL, input=said, max_output_tokens=2)  # type: ignore[arg-type]

    def page(query: str) -> dict[str, Any]:
        answer = httpx.get(f"{url}/v1/responses/{made.id}/input_items?{query}", headers=bearer(key), timeout=20)
        assert answer.status_code == 200, answer.text
        listing: dict[str, Any] = answer.json()
        assert listing["object"] == "list"
        if listing["data"]:
            assert (listing["first_id"], listing["last_id"]) == (listing["data"][0]["id"], listing["data"][-1]["id"])
        return listing

    def texts(listing: dict[str, Any]) -> list[str]:
        return [item["content"][0]["text"] for item in listing["data"]]

    everything = page("")
    assert texts(everything) == ["m4", "m3", "m2", "m1", "m0"] and not everything["has_more"]
    assert everything["data"][0]["content"][0]["type"] == "input_text"
    assert everything["data"][1]["content"][0]["type"] == "output_text"
    first = page("limit=2")
    assert texts(first) == ["m4", "m3"] and first["has_more"]
    second = page(f"limit=2&after={first['last_id']}")
    assert texts(second) == ["m2", "m1"] and second["has_more"]
    last = page(f"limit=2&after={second['last_id']}")
    assert texts(last) == ["m0"] and not last["has_more"]
    assert texts(page("order=asc&limit=3")) == ["m0", "m1", "m2"]
    with oai(url, key) as sdk:  # the SDK's cursor walks the same pages
        walked = [item.content[0].text for item in sdk.responses.input_items.list(made.id, limit=2, order="asc")]  # type: ignore[union-attr]
    assert walked == ["m0", "m1", "m2", "m3", "m4"]
    for query, param in (("limit=0", "limit"), ("limit=101", "limit"), ("limit=ten", "limit"), ("order=up", "order")):
        answer = httpx.get(f"{url}/v1/responses/{made.id}/input_items?{query}", headers=bearer(key), timeout=20)
        error = error_of(answer, 400)
        assert error["type"] == "invalid_request_error" and error["param"] == param, error


# --- background responses ---


def test_a_background_response_is_queued_then_completed_and_its_usage_counted_once(
    url: str, redis_url: str, engine: FakeEngineControl
) -> None:
    name = f"apis-{uuid.uuid4().hex[:8]}"
    key = new_key(redis_url, name=name)
    kinds = ("prompt", "completion")
    before = {k: metric(url, "nemotron_gateway_api_tokens_total", f'api="responses",kind="{k}"') for k in kinds}
    with oai(url, key) as sdk:
        created = sdk.responses.create(model=MODEL, input="one two three", background=True, max_output_tokens=6)
        assert created.status == "queued" and created.id.startswith("resp_") and created.background is True
        done = settled(sdk, created.id)
        again = sdk.responses.retrieve(created.id)
    assert done.status == "completed" and done.id == created.id and done.background is True
    assert done.output_text == "tok0 tok1 tok2 tok3 tok4 tok5"
    assert done.usage is not None and done.usage.output_tokens == 6
    assert again.model_dump() == done.model_dump()
    (run,) = engine_runs(engine, created.id)
    assert run["completed"] and "background" not in run["body"] and run["body"]["stream"] is True
    after = {k: metric(url, "nemotron_gateway_api_tokens_total", f'api="responses",kind="{k}"') for k in kinds}
    assert after["prompt"] - before["prompt"] == done.usage.input_tokens
    assert after["completion"] - before["completion"] == 6
    billed = orjson.loads(keys_output(redis_url, "usage", name, "--json"))
    # The generation, under its model (a retrieve generates nothing: it is billed under no model).
    (row,) = [row for row in billed if row["api"] == "responses" and row["model"] == MODEL]
    assert (row["prompt_tokens"], row["completion_tokens"]) == (done.usage.input_tokens, 6)


def test_a_background_stream_goes_out_as_made_and_is_replayed_from_any_event(url: str, key: str) -> None:
    with oai(url, key) as sdk:
        with sdk.responses.create(model=MODEL, input="Hi", background=True, stream=True, **slow(8)) as stream:
            events = iter(stream)
            created = next(events)
            assert created.type == "response.created"
            response_id = created.response.id  # type: ignore[union-attr]
            # Out before the run finished: the response is still being made.
            assert sdk.responses.retrieve(response_id).status in ("queued", "in_progress")
            rest = list(events)
        assert [e.type for e in rest] == ["response.output_text.delta"] * 8 + ["response.completed"]
        assert rest[-1].response.id == response_id and rest[-1].response.background is True  # type: ignore[union-attr]
        replayed = list(sdk.responses.retrieve(response_id, stream=True, starting_after=3))
        whole = list(sdk.responses.retrieve(response_id, stream=True))
    assert [e.sequence_number for e in replayed] == list(range(4, 10))
    assert replayed[-1].type == "response.completed" and replayed[-1].response.output_text == " ".join(  # type: ignore[union-attr]
        f"tok{i}" for i in range(8)
    )
    assert [e.type for e in whole] == ["response.created", *[e.type for e in rest]]


def test_cancelling_a_background_response_stops_the_engine_and_it_stays_cancelled(
    url: str, key: str, engine: FakeEngineControl
) -> None:
    with oai(url, key) as sdk:
        created = sdk.responses.create(model=MODEL, input="Hi", background=True, **slow(200, 0.1))
        wait_until(lambda: any(r["tokens_sent"] for r in engine_runs(engine, created.id)), timeout=SETTLED)
        assert sdk.responses.cancel(created.id).status == "cancelled"
        wait_until(lambda: engine_runs(engine, created.id)[0]["disconnected"], timeout=SETTLED)
        final = settled(sdk, created.id)
    assert final.status == "cancelled"
    (run,) = engine_runs(engine, created.id)
    assert run["tokens_sent"] < 200 and not run["completed"]


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_a_background_response_outlives_its_gateway(
    fake_engine: FakeEngineControl, engine: FakeEngineControl, tmp_path: Path, how: str
) -> None:
    store = PrivateRedis(tmp_path)  # its own Redis: no other gateway's sweep may take the job
    store.start()
    try:
        key = keys_cli(store.url, "create", "--name", f"apis-{uuid.uuid4().hex[:8]}", "--rpm", "0")
        with run_gateway(fake_engine.base_url, store.url, env=ENV) as first:
            with oai(f"http://127.0.0.1:{first.port}", key) as sdk:
                created = sdk.responses.create(model=MODEL, input="Hi", background=True, **slow(12))
            wait_until(lambda: any(r["tokens_sent"] for r in engine_runs(engine, created.id)), timeout=SETTLED)
            if how == "sigterm":
                first.stop()
            else:
                first.send_signal(signal.SIGKILL)
                wait_until(lambda: first.poll() is not None, timeout=SETTLED)
        with (
            run_gateway(fake_engine.base_url, store.url, env=ENV) as second,
            oai(f"http://127.0.0.1:{second.port}", key) as sdk,
        ):
            assert sdk.responses.retrieve(created.id).status in ("queued", "in_progress")
            done = wait_until(
                lambda: (found := sdk.responses.retrieve(created.id)).status not in ("queued", "in_progress") and found,
                timeout=SETTLED + 15,  # a dead gateway's claim lapses after 15 s
                interval=0.2,
            )
            assert done.status == "completed" and done.output_text == " ".join(f"tok{i}" for i in range(12))
        runs = engine_runs(engine, created.id)
        assert len(runs) == 2 and runs[0]["disconnected"] and runs[1]["completed"]
    finally:
        store.stop()


# --- bounds ---


def test_each_keys_count_and_byte_bounds_evict_its_oldest_and_records_expire(
    gateways: dict[str, str], redis_url: str, db: redis.Redis
) -> None:
    url, counted, sized = gateways["bounded"], new_key(redis_url), new_key(redis_url)
    with oai(url, counted) as sdk:
        made = [sdk.responses.create(model=MODEL, input=f"n{i}", max_output_tokens=2).id for i in range(4)]
        with pytest.raises(openai.NotFoundError):
            sdk.responses.retrieve(made[0])
        assert [sdk.responses.retrieve(i).id for i in made[1:]] == made[1:]
    owner = db.hget(RECORD + made[1], "owner")
    assert owner is not None and db.zcard(f"nemotron:resp-owner:{owner.decode()}") == 3
    assert all(0 < db.ttl(RECORD + i) <= 600 for i in made[1:])
    words = "word " * 600  # about 3000 bytes stored a response
    with oai(url, sized) as sdk:
        big = [sdk.responses.create(model=MODEL, input=words, max_output_tokens=2).id for _ in range(3)]
        with pytest.raises(openai.NotFoundError):
            sdk.responses.retrieve(big[0])
        assert [sdk.responses.retrieve(i).id for i in big[1:]] == big[1:]
        # One response over the bound by itself is answered, not kept, and evicts nothing.
        huge = sdk.responses.create(model=MODEL, input=words * 3, max_output_tokens=2)
        assert huge.output_text == "tok0 tok1"
        with pytest.raises(openai.NotFoundError):
            sdk.responses.retrieve(huge.id)
        assert [sdk.responses.retrieve(i).id for i in big[1:]] == big[1:]
    sized_owner = db.hget(RECORD + big[1], "owner")
    assert sized_owner is not None
    assert 0 < int(db.hget(f"nemotron:resp-sizes:{sized_owner.decode()}", "__total") or 0) <= 8000
    for secret in (counted, sized):
        assert secret.encode() not in stored_state(db)


def test_the_default_ttl_is_set_on_each_record(url: str, key: str, db: redis.Redis) -> None:
    with oai(url, key) as sdk:
        made = sdk.responses.create(model=MODEL, input="Hi", background=True, max_output_tokens=2)
        settled(sdk, made.id)
    assert 0 < db.ttl(RECORD + made.id) <= 30 * 86400
    assert 0 < db.ttl(f"nemotron:resp-events:{made.id}") <= 30 * 86400
    assert key.encode() not in stored_state(db)


def stored_state(db: redis.Redis) -> bytes:
    """Every name and value of the Responses state in Redis, as one blob to search."""
    parts: list[bytes] = []
    for name in db.scan_iter(match="nemotron:resp*"):
        parts.append(name)
        kind = db.type(name).decode()
        if kind == "hash":
            parts += [part for pair in db.hgetall(name).items() for part in pair]
        elif kind == "list":
            parts += db.lrange(name, 0, -1)
        elif kind == "zset":
            parts += db.zrange(name, 0, -1)
        elif kind == "string":
            parts.append(db.get(name) or b"")
    return b"\n".join(parts)


# --- Redis down ---


def test_with_redis_down_stored_state_is_a_503_and_nothing_half_written_is_left(
    fake_engine: FakeEngineControl, tmp_path: Path
) -> None:
    store = PrivateRedis(tmp_path)
    store.start()
    try:
        key = keys_cli(store.url, "create", "--name", f"apis-{uuid.uuid4().hex[:8]}", "--rpm", "0")
        with run_gateway(fake_engine.base_url, store.url, env=ENV) as proc:
            url = f"http://127.0.0.1:{proc.port}"
            with oai(url, key) as sdk:
                kept = sdk.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
            store.stop()
            with httpx.Client(base_url=url, headers=bearer(key), timeout=20) as client:
                for answer in (
                    client.post(
                        "/v1/responses",
                        json={"model": MODEL, "input": "more", "previous_response_id": kept.id, "max_output_tokens": 2},
                    ),
                    client.get(f"/v1/responses/{kept.id}"),
                    client.delete(f"/v1/responses/{kept.id}"),
                    client.post(
                        "/v1/responses",
                        json={"model": MODEL, "input": "Hi", "background": True, "max_output_tokens": 2},
                    ),
                ):
                    assert error_of(answer, 503)["type"] == "service_unavailable"
            store.start()
            with oai(url, key) as sdk:
                assert (
                    wait_until(lambda: ok_or_none(lambda: sdk.responses.retrieve(kept.id)), timeout=SETTLED).id
                    == kept.id
                )
        client = redis.Redis.from_url(store.url)
        try:
            assert [name for name in client.scan_iter(match=f"{RECORD}*")] == [f"{RECORD}{kept.id}".encode()]
            assert client.zcard("nemotron:resp-jobs") == 0
        finally:
            client.close()
    finally:
        store.stop()


def ok_or_none(call: Any) -> Any:
    try:
        return call()
    except openai.APIStatusError:
        return None
