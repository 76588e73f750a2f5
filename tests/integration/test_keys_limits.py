"""API keys and per-key limits end to end: real gateway processes sharing Redis, keys made by the real `keys` CLI.

Gateways A and B share a short window (limits refill in seconds); C keeps the one-minute window, so token
arithmetic is exact, and a strict failed-auth guard. Each test flushes Redis and makes its own keys, and
checks one behaviour, so one failure does not hide the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

import httpx
import openai
import orjson
import pytest
import redis
from openai.types.chat import ChatCompletionMessageParam

from gateway.auth import INVALID_KEY_MESSAGE, KeyStore
from gateway.redis import close_redis, connect_redis
from gateway.responses import ResponseStore
from gateway.settings import Settings
from tests.procs import (
    REPO_ROOT,
    FakeEngineControl,
    ServerProcess,
    async_wait_until,
    free_port,
    run_gateway,
    wait_until,
)

pytestmark = pytest.mark.timeout(90)

MODEL = "nemotron-test"
PEPPER = "keys-limits-test-pepper"
SHORT_WINDOW = 8
LONG_WINDOW = 60
GUARD_LIMIT = 5
GUARD_BLOCK = 2
BURST_ATTEMPTS = 3  # bursts made before a loaded machine fails the exactness test
SECRET_RE = re.compile(r"sk-[A-Za-z0-9_-]{43}")
DISPLAY_LEN = len("sk-") + 6
# A well-formed secret that no key has.
UNKNOWN_SECRET = "sk-" + "A" * 43

BASE_ENV = {"NEMOTRON_AUTH__SECRET": PEPPER, "NEMOTRON_RELAY__PROBE_INTERVAL": "0.2"}
SHORT_ENV = {**BASE_ENV, "NEMOTRON_LIMITS__WINDOW": str(SHORT_WINDOW)}
GUARDED_ENV = {
    **BASE_ENV,
    "NEMOTRON_AUTH__FAILED_AUTH_LIMIT": str(GUARD_LIMIT),
    "NEMOTRON_AUTH__FAILED_AUTH_WINDOW": "10",
    "NEMOTRON_AUTH__FAILED_AUTH_BLOCK": str(GUARD_BLOCK),
}
OVERLAP_ENV = {**BASE_ENV, "NEMOTRON_LIMITS__OVERLAP_ADMISSION": "true"}
CLI_ENV = {**os.environ, "NEMOTRON_AUTH__SECRET": PEPPER}


@pytest.fixture(scope="module")
def gateways(fake_engine: FakeEngineControl, redis_url: str) -> Iterator[dict[str, ServerProcess]]:
    """Gateways a, b (short window), c (one-minute window, strict guard) and d (one-minute window, admission beside
    the engine request), started side by side."""
    envs = {"a": SHORT_ENV, "b": SHORT_ENV, "c": GUARDED_ENV, "d": OVERLAP_ENV}
    with ThreadPoolExecutor(len(envs)) as pool:
        futures = {
            name: pool.submit(run_gateway, fake_engine.base_url, redis_url, env=env) for name, env in envs.items()
        }
        wait(futures.values())
    with contextlib.ExitStack() as stack:
        started = {name: stack.enter_context(f.result()) for name, f in futures.items() if f.exception() is None}
        for future in futures.values():
            if (error := future.exception()) is not None:
                raise error
        yield started


@pytest.fixture
def urls(gateways: dict[str, ServerProcess], engine: FakeEngineControl) -> dict[str, str]:
    # `engine` resets the fake's request log before each test.
    return {name: f"http://127.0.0.1:{proc.port}" for name, proc in gateways.items()}


# --- helpers ---


def _cli_argv(redis_url: str, args: Sequence[str]) -> list[str]:
    # The verb's flags come after it: `keys create --name N ... --redis-url URL`.
    return [sys.executable, "-m", "gateway", "keys", *args, "--redis-url", redis_url]


def keys_cli(redis_url: str, *commands: Sequence[str]) -> list[subprocess.CompletedProcess[str]]:
    """Run `keys` CLI commands side by side (each takes a second or two to start); their results in order."""
    with contextlib.ExitStack() as stack:
        procs = [
            stack.enter_context(
                subprocess.Popen(
                    _cli_argv(redis_url, args),
                    cwd=REPO_ROOT,
                    env=CLI_ENV,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
            for args in commands
        ]
        results = []
        for args, proc in zip(commands, procs, strict=True):
            out, err = proc.communicate(timeout=60)
            results.append(subprocess.CompletedProcess(list(args), proc.returncode, out, err))
        return results


def last_line_secret(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, f"{result.args} failed: {result.stderr}"
    lines = result.stdout.strip().splitlines()
    secret = lines[-1]
    assert SECRET_RE.fullmatch(secret), f"last line of {result.args} is not a secret: {secret!r}"
    assert all(secret not in line for line in lines[:-1]), "the secret must appear on the last line only"
    return secret


def without_last_line(result: subprocess.CompletedProcess[str]) -> str:
    """What a command printed besides the secret on its last line."""
    return "\n".join(result.stdout.splitlines()[:-1]) + result.stderr


def create_keys(redis_url: str, specs: dict[str, Sequence[str]]) -> dict[str, str]:
    """Create keys (name -> extra flags) with the CLI; name -> secret."""
    results = keys_cli(redis_url, *(["create", "--name", name, *flags] for name, flags in specs.items()))
    return {name: last_line_secret(result) for name, result in zip(specs, results, strict=True)}


def auth(secret: str, address: str) -> dict[str, str]:
    # The gateways trust 127.0.0.1's X-Forwarded-For: each test is its own client address for the guard.
    return {"Authorization": f"Bearer {secret}", "X-Forwarded-For": address}


def completion(prompt: str = "hi", max_tokens: int = 1, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, **extra}


def error_of(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"}, body
    error: dict[str, Any] = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return error


def assert_rate_limited(response: httpx.Response, phrase: str, max_retry_after: int) -> int:
    """A 429 in OpenAI's envelope whose message contains `phrase`; returns its Retry-After."""
    assert response.status_code == 429, response.text
    error = error_of(response)
    assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded", error
    assert phrase in error["message"], error["message"]
    retry_after = response.headers["retry-after"]
    assert retry_after.isdigit() and 1 <= int(retry_after) <= max_retry_after, retry_after
    return int(retry_after)


def per(window: int) -> str:
    """How refusal messages name the window."""
    return "minute" if window == 60 else f"{window} s"


def remaining(response: httpx.Response, kind: str) -> int:
    return int(response.headers[f"x-ratelimit-remaining-{kind}"])


def redis_dump(url: str) -> bytes:
    """Every key of the db with its value, whatever its type, as one blob."""
    client = redis.Redis.from_url(url, socket_timeout=5.0, socket_connect_timeout=5.0)
    parts: list[bytes] = []
    try:
        for name in client.scan_iter(count=500):
            kind = client.type(name)
            value: Any
            if kind == b"string":
                value = client.get(name)
            elif kind == b"hash":
                value = client.hgetall(name)
            elif kind == b"zset":
                value = client.zrange(name, 0, -1, withscores=True)
            elif kind == b"set":
                value = client.smembers(name)
            elif kind == b"list":
                value = client.lrange(name, 0, -1)
            elif kind == b"stream":  # the audit trail of key changes
                value = client.xrange(name)
            else:
                value = kind
            parts += [name, repr(value).encode()]
    finally:
        client.close()
    assert parts, "the scan found nothing: the test did not write what it meant to"
    return b"\n".join(parts)


def assert_no_secret(text: str | bytes, secrets: Sequence[str], where: str) -> None:
    """Neither a secret nor any 16 characters of what its display prefix hides occur in `text`."""
    blob = text.encode() if isinstance(text, str) else text
    for secret in secrets:
        hidden = secret[DISPLAY_LEN:]
        for start in range(len(hidden) - 15):
            assert hidden[start : start + 16].encode() not in blob, f"part of a secret leaked into {where}"


def assert_invalid_key(response: httpx.Response) -> None:
    assert response.status_code == 401, response.text
    error = error_of(response)
    assert error["message"] == INVALID_KEY_MESSAGE and error["code"] == "invalid_api_key", error


# --- requests per window: exact across processes ---


async def test_requests_limit_is_exact_across_two_gateways(
    urls: dict[str, str], redis_clean: str, engine: FakeEngineControl
) -> None:
    rpm = 10
    flags = ["--rpm", str(rpm), "--tpm", "0", "--max-concurrency", "0"]
    targets = [urls["a"], urls["b"]]
    async with httpx.AsyncClient(timeout=10, limits=httpx.Limits(max_connections=200)) as client:
        # One request frees every window/rpm seconds, so a burst slower than that would rightly admit more: a
        # burst slowed by a loaded machine proves nothing, and is made again with a fresh key.
        for attempt in range(BURST_ATTEMPTS):
            secret = (await asyncio.to_thread(create_keys, redis_clean, {f"burst-{attempt}": flags}))[
                f"burst-{attempt}"
            ]
            headers = auth(secret, "198.51.100.1")
            await asyncio.to_thread(engine.reset)
            for url in targets:  # warm both key caches without spending requests (/v1/models is not limited)
                assert (await client.get(f"{url}/v1/models", headers=headers)).status_code == 200
            started = time.monotonic()
            responses = await asyncio.gather(
                *(
                    client.post(f"{targets[i % 2]}/v1/completions", json=completion(), headers=headers)
                    for i in range(5 * rpm)
                )
            )
            burst = time.monotonic() - started
            if burst < SHORT_WINDOW / rpm:
                break
        else:
            pytest.fail(f"{BURST_ATTEMPTS} bursts took {burst:.2f} s or more, too slow to test exactness")
        refused = [r for r in responses if r.status_code != 200]
        assert len(responses) - len(refused) == rpm, sorted(r.status_code for r in responses)
        retry_after = 0
        for response in refused:
            seconds = assert_rate_limited(response, f"requests per {per(SHORT_WINDOW)} (limit {rpm})", SHORT_WINDOW)
            retry_after = max(retry_after, seconds)
            assert 0 < int(response.headers["retry-after-ms"]) <= seconds * 1000
            assert remaining(response, "requests") == 0
        assert len(await engine.arequests()) == rpm, "refused requests must not reach the engine"

        await asyncio.sleep(retry_after)
        again = await client.post(f"{urls['b']}/v1/completions", json=completion(), headers=headers)
        assert again.status_code == 200, again.text


async def test_with_overlap_admission_a_refused_request_is_aborted_at_the_engine_and_its_429_does_not_wait(
    urls: dict[str, str], redis_clean: str, engine: FakeEngineControl
) -> None:
    rpm = 2
    flags = ["--rpm", str(rpm), "--tpm", "0", "--max-concurrency", "0"]
    secret = (await asyncio.to_thread(create_keys, redis_clean, {"overlap": flags}))["overlap"]
    headers = auth(secret, "198.51.100.21")
    # The engine would work on it for longer than the client waits (10 s) unless it is aborted: a 429 that waited
    # for the engine could not come at all.
    slow = completion(fake_prefill_delay=600.0)
    refusal = f"requests per {per(LONG_WINDOW)} (limit {rpm})"
    async with httpx.AsyncClient(base_url=urls["d"], timeout=10) as client:
        for left in range(rpm - 1, -1, -1):  # the first admitted before the engine request, the next beside it
            answer = await client.post("/v1/completions", json=completion(), headers=headers)
            assert answer.status_code == 200 and remaining(answer, "requests") == left, answer.text
        refused = await client.post("/v1/completions", json=slow, headers=headers)
        assert_rate_limited(refused, refusal, LONG_WINDOW)
        assert remaining(refused, "requests") == 0
        # It reached the engine beside its admission, which closed its connection when Redis refused it ...
        aborted = await async_wait_until(
            lambda: _slow_ones_gone(engine), within=5, message="the refused request was not aborted at the engine"
        )
        assert len(aborted) == 1
        # ... and the key's next request waits for Redis (here the refusal this process remembers): the engine
        # never sees it.
        again = await client.post("/v1/completions", json=slow, headers=headers)
        assert_rate_limited(again, refusal, LONG_WINDOW)
        assert len(await engine.arequests()) == rpm + 1


async def _slow_ones_gone(engine: FakeEngineControl) -> list[dict[str, Any]]:
    records = await engine.arequests()
    slow = [r for r in records if isinstance(r["body"], dict) and "fake_prefill_delay" in r["body"]]
    return [r for r in slow if r["disconnected"] and not r["completed"]]


# --- concurrency: streams hold a slot until they end or their client leaves ---


SLOW_STREAM = completion(max_tokens=10, stream=True, fake_token_delay=0.2)  # about 2 s
IN_FLIGHT = "too many requests in flight for this key (limit 2)"


async def test_concurrency_slot_is_held_by_a_stream_and_settled_before_its_done(
    urls: dict[str, str], redis_clean: str
) -> None:
    rpm = 6  # gateway c: one-minute window, so the requests bucket barely refills during the test
    flags = ["--max-concurrency", "2", "--rpm", str(rpm), "--tpm", "0"]
    secret = (await asyncio.to_thread(create_keys, redis_clean, {"conc": flags}))["conc"]
    headers = auth(secret, "198.51.100.2")
    async with httpx.AsyncClient(base_url=urls["c"], timeout=10) as client:
        async with (
            client.stream("POST", "/v1/completions", json=SLOW_STREAM, headers=headers) as first,
            client.stream("POST", "/v1/completions", json=SLOW_STREAM, headers=headers) as second,
        ):
            assert first.status_code == second.status_code == 200
            assert remaining(second, "requests") == rpm - 2
            third = await client.post("/v1/completions", json=completion(), headers=headers)
            assert assert_rate_limited(third, IN_FLIGHT, 1) == 1
            assert remaining(third, "requests") == rpm - 2, "a refused request must not spend a request"
            assert b"data: [DONE]" in await first.aread()
            # The slot is settled before [DONE] goes out: the very next request is admitted.
            fourth = await client.post("/v1/completions", json=completion(), headers=headers)
            assert fourth.status_code == 200, fourth.text
            assert remaining(fourth, "requests") == rpm - 3
            await second.aread()


async def test_concurrency_slot_frees_when_its_client_leaves_mid_stream(urls: dict[str, str], redis_clean: str) -> None:
    rpm = 3
    flags = ["--max-concurrency", "2", "--rpm", str(rpm), "--tpm", "0"]
    secret = (await asyncio.to_thread(create_keys, redis_clean, {"leaver": flags}))["leaver"]
    headers = auth(secret, "198.51.100.12")
    async with httpx.AsyncClient(base_url=urls["c"], timeout=10) as client:

        async def admitted() -> httpx.Response | None:
            response = await client.post("/v1/completions", json=completion(), headers=headers)
            if response.status_code == 200:
                return response
            assert_rate_limited(response, IN_FLIGHT, 1)
            return None

        async with (
            client.stream("POST", "/v1/completions", json=SLOW_STREAM, headers=headers) as first,
            client.stream("POST", "/v1/completions", json=SLOW_STREAM, headers=headers) as second,
        ):
            assert first.status_code == second.status_code == 200
            assert await admitted() is None
            events = 0
            async for line in first.aiter_lines():
                events += line.startswith("data: ")
                if events == 3:
                    break
            await first.aclose()  # the client leaves mid-stream
            # Well before the stream would have ended (2 s) and its lease expired (30 s).
            third = await async_wait_until(admitted, within=5, interval=0.05, message="the slot was not freed")
            assert remaining(third, "requests") == 0, "concurrency refusals must not have spent requests"
        fourth = await client.post("/v1/completions", json=completion(), headers=headers)
        assert_rate_limited(fourth, f"requests per {per(LONG_WINDOW)} (limit {rpm})", LONG_WINDOW)


# --- tokens per window: charged up front, reconciled with the engine's usage ---


def test_tokens_are_charged_up_front_and_reconciled_to_real_usage(urls: dict[str, str], redis_clean: str) -> None:
    tpm = 100
    flags = ["--tpm", str(tpm), "--rpm", "0", "--max-concurrency", "0"]
    secret = create_keys(redis_clean, {"tokens": flags})["tokens"]
    headers = auth(secret, "198.51.100.3")
    # Three 40-character words: the gateway estimates 122 // 4 + 1 = 31 prompt tokens, the fake engine counts 3.
    prompt, max_tokens = " ".join(["x" * 40] * 3), 9
    charge, used = 31 + max_tokens, 3 + max_tokens
    with httpx.Client(base_url=urls["c"], timeout=10) as client:
        started = time.monotonic()

        def assert_remaining_tokens(response: httpx.Response, expected: int) -> None:
            # The bucket drains tpm per window meanwhile; that may add whole tokens, never take any.
            slack = int((time.monotonic() - started) * tpm / LONG_WINDOW)
            assert expected <= remaining(response, "tokens") <= expected + slack, response.headers

        # Charged 40 but reconciled to 12 each: six fit (without refunds: two). The sixth fills the limit to
        # exactly 100%, and is a stream, reconciled from its usage chunk.
        for index in range(6):
            body = completion(prompt, max_tokens, stream=index == 5)
            response = client.post("/v1/completions", json=body, headers=headers)
            assert response.status_code == 200, response.text
            if index < 5:
                assert response.json()["usage"]["total_tokens"] == used
            else:
                assert b"data: [DONE]" in response.content
                assert b'"usage":{' not in response.content, "the usage chunk the client did not ask for leaked"
            assert_remaining_tokens(response, tpm - (index * used + charge))

        refused = client.post("/v1/completions", json=completion(prompt, max_tokens), headers=headers)
        assert_rate_limited(refused, f"tokens per {per(LONG_WINDOW)} (limit {tpm}, requested {charge})", LONG_WINDOW)
        assert_remaining_tokens(refused, tpm - 6 * used)


def test_tokens_limit_is_usable_to_the_last_token(urls: dict[str, str], redis_clean: str) -> None:
    tpm = 100
    flags = ["--tpm", str(tpm), "--rpm", "0", "--max-concurrency", "0"]
    secret = create_keys(redis_clean, {"last-token": flags})["last-token"]
    headers = auth(secret, "198.51.100.13")
    with httpx.Client(base_url=urls["c"], timeout=10) as client:
        # "hi" is estimated and counted as 1 token: 1 + 89 leaves exactly 10.
        first = client.post("/v1/completions", json=completion("hi", 89), headers=headers)
        assert first.status_code == 200, first.text
        exact = client.post("/v1/completions", json=completion("hi", 9), headers=headers)
        assert exact.status_code == 200, f"the last 10 tokens of the limit are locked out: {exact.text}"
        assert exact.json()["usage"]["total_tokens"] == 10
        assert remaining(exact, "tokens") <= 1  # the bucket may have drained a token meanwhile
        over = client.post("/v1/completions", json=completion("hi", 4), headers=headers)
        assert_rate_limited(over, f"tokens per {per(LONG_WINDOW)} (limit {tpm}, requested 5)", LONG_WINDOW)


def test_a_request_larger_than_the_tokens_limit_is_refused_as_too_large(urls: dict[str, str], redis_clean: str) -> None:
    secret = create_keys(redis_clean, {"small": ["--tpm", "100", "--rpm", "0"]})["small"]
    with httpx.Client(base_url=urls["c"], timeout=10) as client:
        response = client.post("/v1/completions", json=completion("hi", 100), headers=auth(secret, "198.51.100.14"))
    assert_rate_limited(response, "Request too large", LONG_WINDOW)


def test_a_key_over_its_requests_limit_is_refused_before_its_body_is_read(
    urls: dict[str, str], redis_clean: str
) -> None:
    secret = create_keys(redis_clean, {"over": ["--rpm", "1", "--tpm", "0", "--max-concurrency", "0"]})["over"]
    headers = auth(secret, "198.51.100.15")
    with httpx.Client(base_url=urls["c"], timeout=10) as client:
        assert client.post("/v1/completions", json=completion(), headers=headers).status_code == 200
        assert_rate_limited(
            client.post("/v1/completions", json=completion(), headers=headers),
            f"requests per {per(LONG_WINDOW)} (limit 1)",
            LONG_WINDOW,
        )
    # Now a megabyte is announced and never sent: a gateway that reads the body first would wait for it (and
    # answer 408 at its body deadline); the refusal must come at once, from the headers alone.
    port = int(urls["c"].rsplit(":", 1)[1])
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Authorization: {headers['Authorization']}\r\nX-Forwarded-For: {headers['X-Forwarded-For']}\r\n"
        "Content-Length: 1000000\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        raw.sendall(head.encode() + b'{"model": "')
        answer = raw.recv(65536)
        # The head and the body may arrive in two reads; the body is the envelope naming the limit.
        while answer.startswith(b"HTTP/1.1 429") and b"limit 1" not in answer and (more := raw.recv(65536)):
            answer += more
    assert answer.startswith(b"HTTP/1.1 429"), answer[:200]
    assert b"limit 1" in answer


# --- revocation and rotation reach every process within a second ---


async def _keys_cli_async(redis_url: str, args: Sequence[str]) -> tuple[subprocess.CompletedProcess[str], float]:
    """One `keys` command without blocking the loop; its result and when it exited."""
    proc = await asyncio.create_subprocess_exec(
        *_cli_argv(redis_url, args),
        cwd=REPO_ROOT,
        env=CLI_ENV,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        async with asyncio.timeout(60):
            out, err = await proc.communicate()
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    ended = time.monotonic()
    return subprocess.CompletedProcess(list(args), proc.returncode or 0, out.decode(), err.decode()), ended


async def _change_while_in_use(
    client: httpx.AsyncClient, url: str, headers: dict[str, str], redis_url: str, verb: str, name: str
) -> subprocess.CompletedProcess[str]:
    """`keys VERB NAME` while `url` keeps authenticating `headers` (its cache stays warm); then `url` must
    refuse `headers` (told by pub/sub, or at worst when its cache entry ends: tests/integration/test_keystore.py
    tells the two apart)."""
    assert (await client.get(f"{url}/v1/models", headers=headers)).status_code == 200
    done = asyncio.Event()

    async def keep_warm() -> None:
        while not done.is_set():
            if (await client.get(f"{url}/v1/models", headers=headers)).status_code != 200:
                return
            await asyncio.sleep(0.05)

    warmer = asyncio.create_task(keep_warm())
    try:
        result, _ = await _keys_cli_async(redis_url, [verb, name])
    finally:
        done.set()
        await warmer
    assert result.returncode == 0, result.stderr

    async def refused() -> bool:
        response = await client.get(f"{url}/v1/models", headers=headers)
        if response.status_code == 401:
            assert_invalid_key(response)
            return True
        assert response.status_code == 200, response.text
        return False

    await async_wait_until(refused, within=10, message=f"the other gateway still accepts the key after `keys {verb}`")
    assert_invalid_key(await client.post(f"{url}/v1/completions", json=completion(), headers=headers))
    return result


async def test_revoke_reaches_another_gateway(urls: dict[str, str], redis_clean: str) -> None:
    secret = (await asyncio.to_thread(create_keys, redis_clean, {"to-revoke": []}))["to-revoke"]
    async with httpx.AsyncClient(timeout=5) as client:
        await _change_while_in_use(client, urls["b"], auth(secret, "198.51.100.4"), redis_clean, "revoke", "to-revoke")


async def test_rotate_reaches_another_gateway(urls: dict[str, str], redis_clean: str) -> None:
    secret = (await asyncio.to_thread(create_keys, redis_clean, {"to-rotate": []}))["to-rotate"]
    address = "198.51.100.15"
    async with httpx.AsyncClient(timeout=5) as client:
        rotated = await _change_while_in_use(
            client, urls["b"], auth(secret, address), redis_clean, "rotate", "to-rotate"
        )
        new = auth(last_line_secret(rotated), address)
        for url in (urls["b"], urls["a"]):
            response = await client.post(f"{url}/v1/completions", json=completion(), headers=new)
            assert response.status_code == 200, response.text


async def test_a_revoked_key_and_an_unknown_one_get_the_same_401(urls: dict[str, str], redis_clean: str) -> None:
    secret = (await asyncio.to_thread(create_keys, redis_clean, {"revoked": []}))["revoked"]
    (revoked,) = await asyncio.to_thread(keys_cli, redis_clean, ["revoke", "revoked"])
    assert revoked.returncode == 0, revoked.stderr
    bodies = []
    for api_key in (secret, UNKNOWN_SECRET):
        async with openai.AsyncOpenAI(
            base_url=f"{urls['a']}/v1",
            api_key=api_key,
            max_retries=0,
            timeout=10,
            default_headers={"X-Forwarded-For": "198.51.100.16"},
        ) as sdk:
            with pytest.raises(openai.AuthenticationError) as caught:
                await sdk.completions.create(model=MODEL, prompt="hi", max_tokens=1)
            bodies.append(caught.value.body)
    assert bodies[0] == bodies[1], "a revoked key must be indistinguishable from an unknown one"
    assert bodies[0] == {
        "message": INVALID_KEY_MESSAGE,
        "type": "authentication_error",
        "param": None,
        "code": "invalid_api_key",
    }


# --- the official SDK sees OpenAI's exception classes and headers ---


MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]


def _sdk(url: str, api_key: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{url}/v1",
        api_key=api_key,
        max_retries=0,
        timeout=10,
        default_headers={"X-Forwarded-For": "198.51.100.5"},
    )


def test_openai_sdk_sees_missing_unknown_and_forbidden_keys(urls: dict[str, str], redis_clean: str) -> None:
    secret = create_keys(redis_clean, {"sdk-other": ["--models", "other-model"]})["sdk-other"]
    with _sdk(urls["a"], "unused") as client, pytest.raises(openai.AuthenticationError) as missing:
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            extra_headers={"Authorization": openai.omit},
        )
    assert "didn't provide an API key" in missing.value.message
    with _sdk(urls["a"], UNKNOWN_SECRET) as client, pytest.raises(openai.AuthenticationError) as unknown:
        client.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert unknown.value.code == "invalid_api_key" and INVALID_KEY_MESSAGE in unknown.value.message
    with _sdk(urls["a"], secret) as client, pytest.raises(openai.PermissionDeniedError) as denied:
        client.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert "may not use the model 'nemotron-test'" in denied.value.message


def test_openai_sdk_reads_rate_limit_headers_and_the_429(urls: dict[str, str], redis_clean: str) -> None:
    secret = create_keys(redis_clean, {"sdk": ["--rpm", "2", "--tpm", "1000", "--max-concurrency", "0"]})["sdk"]
    reset = re.compile(r"\d+(\.\d+)?(ms|s)|(\d+h)?\d+m\d+(\.\d+)?s")
    with _sdk(urls["a"], secret) as client:
        raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=2)
        streamed = client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=2,
            stream=True,
        )
        for response, left in ((raw, 1), (streamed, 0)):
            headers = response.headers
            assert headers["x-ratelimit-limit-requests"] == "2"
            assert headers["x-ratelimit-remaining-requests"] == str(left)
            assert headers["x-ratelimit-limit-tokens"] == "1000"
            assert 0 <= int(headers["x-ratelimit-remaining-tokens"]) < 1000
            for kind in ("requests", "tokens"):
                assert reset.fullmatch(headers[f"x-ratelimit-reset-{kind}"]), headers[f"x-ratelimit-reset-{kind}"]
        assert raw.parse().choices[0].message.content == "tok0 tok1"
        with streamed.parse() as stream:
            assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "tok0 tok1"

        with pytest.raises(openai.RateLimitError) as limited:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert limited.value.code == "rate_limit_exceeded"
    assert f"requests per {per(SHORT_WINDOW)} (limit 2)" in limited.value.message
    assert "Retry in" in limited.value.message
    assert limited.value.response.headers["retry-after"].isdigit()


# --- the failed-auth guard ---


BLOCKED = "Too many failed authentication attempts"


def _block(client: httpx.Client, url: str, address: str) -> float:
    """Fail authentication GUARD_LIMIT times from `address` (missing, malformed, unknown keys); a moment no later
    than the block's start."""
    bad = [{"X-Forwarded-For": address}, auth("sk-wrong", address), auth(UNKNOWN_SECRET, address)]
    for attempt in range(GUARD_LIMIT):
        sent = time.monotonic()  # before the block can begin: it begins while the last of these is answered
        response = client.post(f"{url}/v1/completions", json=completion(), headers=bad[attempt % len(bad)])
        assert response.status_code == 401, response.text
    return sent


def test_failed_auth_guard_blocks_guesses_but_not_a_known_key_behind_the_same_address(
    urls: dict[str, str], redis_clean: str
) -> None:
    secret = create_keys(redis_clean, {"guarded": []})["guarded"]
    address, neighbour = "198.51.100.6", "198.51.100.7"
    with httpx.Client(timeout=5) as client:

        def post(url: str, headers: dict[str, str]) -> httpx.Response:
            return client.post(f"{url}/v1/completions", json=completion(), headers=headers)

        assert post(urls["c"], auth(secret, address)).status_code == 200  # a colleague behind the same NAT
        _block(client, urls["c"], address)
        assert_rate_limited(post(urls["c"], auth(UNKNOWN_SECRET, address)), BLOCKED, GUARD_BLOCK)
        assert_rate_limited(post(urls["c"], {"X-Forwarded-For": address}), BLOCKED, GUARD_BLOCK)
        # The valid key keeps working from the blocked address: the block stops guessing, not the address.
        response = post(urls["c"], auth(secret, address))
        assert response.status_code == 200, response.text
        # The block lives in Redis: another gateway refuses the address's guesses too, and, having never seen
        # this key, cannot tell it from a guess without a lookup, so it refuses it until the block ends.
        assert_rate_limited(post(urls["a"], auth(UNKNOWN_SECRET, address)), BLOCKED, GUARD_BLOCK)
        assert_rate_limited(post(urls["a"], auth(secret, address)), BLOCKED, GUARD_BLOCK)
        assert post(urls["c"], auth(secret, neighbour)).status_code == 200


def test_failed_auth_guard_lets_the_address_back_after_the_block(urls: dict[str, str], redis_clean: str) -> None:
    secret = create_keys(redis_clean, {"returning": []})["returning"]
    address = "198.51.100.17"
    with httpx.Client(timeout=5) as client:
        blocked_at = _block(client, urls["c"], address)

        def served(url: str) -> bool:
            response = client.post(f"{url}/v1/completions", json=completion(), headers=auth(secret, address))
            if response.status_code != 200:
                assert_rate_limited(response, BLOCKED, GUARD_BLOCK)
            return response.status_code == 200

        for url in (urls["c"], urls["a"]):
            wait_until(functools.partial(served, url), timeout=GUARD_BLOCK + 10, interval=0.1)
        # Not before the block's end: read from before it began (Redis's clock counts milliseconds).
        assert time.monotonic() - blocked_at >= GUARD_BLOCK - 0.005, "the block ended early"


# --- secrets never leave the CLI's last line ---


def test_secrets_never_leak_into_redis_logs_metrics_or_errors(
    gateways: dict[str, ServerProcess], urls: dict[str, str], redis_clean: str
) -> None:
    created = keys_cli(
        redis_clean,
        ["create", "--name", "leak-a", "--rpm", "2", "--max-concurrency", "0"],
        ["create", "--name", "leak-b", "--models", "other-model"],
    )
    secret_a, secret_b = (last_line_secret(result) for result in created)
    guess = secret_a[:-1] + ("B" if secret_a[-1] != "B" else "C")  # a near miss must not be logged either
    address = "198.51.100.8"
    outputs = [without_last_line(result) for result in created]
    with httpx.Client(timeout=10) as client:
        a, b = urls["a"], urls["b"]
        errors: list[httpx.Response] = []

        def post(url: str, secret: str, body: Any = None) -> httpx.Response:
            response = client.post(
                f"{url}/v1/completions", json=completion() if body is None else body, headers=auth(secret, address)
            )
            if response.status_code != 200:
                errors.append(response)
            return response

        assert post(a, secret_a).status_code == 200
        with client.stream(
            "POST", f"{b}/v1/completions", json=completion(max_tokens=3, stream=True), headers=auth(secret_a, address)
        ) as stream:
            assert stream.status_code == 200
            assert b"[DONE]" in stream.read()
        assert post(b, guess).status_code == 401
        assert post(a, secret_a + "x").status_code == 401
        errors.append(client.post(f"{a}/v1/completions", json=completion(), headers={"Authorization": secret_a}))
        assert post(a, secret_b).status_code == 403
        assert post(b, secret_a).status_code == 429
        assert post(a, secret_a, {"model": MODEL, "prompt": 7}).status_code == 400
        assert post(a, secret_a, completion(model="other-model")).status_code == 404

        (rotated,) = keys_cli(redis_clean, ["rotate", "leak-a"])
        new = last_line_secret(rotated)
        outputs.append(without_last_line(rotated))
        assert client.get(f"{b}/v1/models", headers=auth(new, address)).status_code == 200
        assert post(b, secret_a).status_code == 401
        metrics = [client.get(f"{url}/metrics").text for url in (a, b)]

    secrets = [secret_a, secret_b, new, guess]
    dump = redis_dump(redis_clean)
    assert_no_secret(dump, secrets, "Redis")
    assert PEPPER.encode() not in dump
    for name, proc in gateways.items():
        assert_no_secret(proc.log_text(), secrets, f"the log of gateway {name}")
        assert PEPPER not in proc.log_text()
    for text in metrics:
        assert_no_secret(text, secrets, "/metrics")
    assert len(errors) >= 7
    for response in errors:
        assert_no_secret(response.text + str(response.headers), secrets, f"a {response.status_code} response")
    for text in outputs:
        assert_no_secret(text, secrets, "the CLI's output")


# --- Redis down: fail closed, fast ---


@pytest.mark.parametrize("outage", ["closed port", "silent server"])
def test_redis_down_fails_closed_fast(engine: FakeEngineControl, outage: str) -> None:
    with contextlib.ExitStack() as stack:
        if outage == "closed port":
            port = free_port()
        else:
            # A silent Redis accepts connections (the kernel does) and never answers.
            silent = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            silent.bind(("127.0.0.1", 0))
            silent.listen(128)
            port = silent.getsockname()[1]
        gateway = stack.enter_context(
            run_gateway(engine.base_url, f"redis://127.0.0.1:{port}/0", wait_ready=False, env=BASE_ENV)
        )
        client = stack.enter_context(httpx.Client(timeout=10))
        headers = auth(UNKNOWN_SECRET, "198.51.100.9")
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
        base = f"http://127.0.0.1:{gateway.port}"
        # Each Redis call is bounded by redis.command_timeout (1 s), far below the client's 10 s: an answer that
        # waited on the silent server could not come before the client gives up (httpx.ReadTimeout).
        for path, body in (("/v1/completions", completion()), ("/v1/chat/completions", chat)):
            response = client.post(f"{base}{path}", json=body, headers=headers)
            assert response.status_code == 503, response.text
            error = error_of(response)
            assert error["code"] == "key_store_unavailable" and error["type"] == "service_unavailable", error
            assert response.headers["retry-after"].isdigit()
        ready = client.get(f"{base}/ready")
        assert ready.status_code == 503
        assert ready.json()["redis"]["ok"] is False and "Redis" in ready.json()["redis"]["reason"]


# --- the keys CLI ---


def test_keys_cli_create_race_and_unknown_names(redis_clean: str) -> None:
    # Two creates race for one name: exactly one wins.
    first, second, revoke, show_unknown = keys_cli(
        redis_clean,
        ["create", "--name", "cli-key", "--rpm", "5"],
        ["create", "--name", "cli-key", "--rpm", "5"],
        ["revoke", "no-such-key"],
        ["show", "no-such-key"],
    )
    winner, duplicate = (first, second) if first.returncode == 0 else (second, first)
    secret = last_line_secret(winner)
    assert duplicate.returncode == 1
    assert duplicate.stderr.strip() == "error: An API key named 'cli-key' already exists."
    assert not SECRET_RE.search(duplicate.stdout), "a refused create must not print a secret"
    for result in (revoke, show_unknown):
        assert result.returncode == 1
        assert result.stderr.strip() == "error: No API key is named 'no-such-key'."
    for result in (duplicate, revoke, show_unknown):
        assert_no_secret(result.stdout + result.stderr, [secret], "the CLI's output")


def test_keys_cli_lists_and_shows_usage(urls: dict[str, str], redis_clean: str) -> None:
    secret = create_keys(redis_clean, {"cli-usage": ["--rpm", "5"]})["cli-usage"]
    headers = auth(secret, "198.51.100.10")
    with httpx.Client(base_url=urls["a"], timeout=10) as client:
        for body in (completion("one two three", 4), completion("one two three", 4, stream=True)):
            assert client.post("/v1/completions", json=body, headers=headers).status_code == 200
        assert client.post("/v1/completions", json={"model": MODEL}, headers=headers).status_code == 400
        assert client.post("/v1/completions", json=completion("one two three", 4), headers=headers).status_code == 200
    requests, tokens = 3, 3 * (3 + 4)  # the 400 never reached the limiter

    listing, shown = keys_cli(redis_clean, ["list", "--json"], ["show", "cli-usage"])
    assert listing.returncode == 0, listing.stderr
    rows = orjson.loads(listing.stdout)
    assert [row["name"] for row in rows] == ["cli-usage"]
    assert rows[0]["prefix"] == secret[:DISPLAY_LEN]
    assert rows[0]["usage_today"]["requests"] == requests and rows[0]["usage_today"]["tokens"] == tokens
    assert shown.returncode == 0, shown.stderr
    assert re.search(rf"^requests today:\s+{requests}$", shown.stdout, re.MULTILINE), shown.stdout
    assert re.search(rf"^tokens today:\s+{tokens}$", shown.stdout, re.MULTILINE), shown.stdout
    for result in (listing, shown):
        assert_no_secret(result.stdout + result.stderr, [secret], "the CLI's output")


def test_keys_cli_sets_a_priority_and_refuses_a_negative_one(redis_clean: str) -> None:
    create_keys(redis_clean, {"cli-batch": ["--priority", "5"], "cli-plain": []})
    (batch, plain) = keys_cli(redis_clean, ["show", "cli-batch", "--json"], ["show", "cli-plain", "--json"])
    assert orjson.loads(batch.stdout)["priority"] == 5
    assert orjson.loads(plain.stdout)["priority"] == 0  # NEMOTRON_LIMITS__DEFAULT_PRIORITY
    (changed, refused) = keys_cli(
        redis_clean, ["set", "cli-plain", "--priority", "2"], ["set", "cli-batch", "--priority", "-1"]
    )
    assert changed.returncode == 0, changed.stderr
    assert refused.returncode == 2 and "a priority is 0 (most urgent) or more" in refused.stderr
    (reset,) = keys_cli(redis_clean, ["set", "cli-batch", "--priority", "default"])
    assert reset.returncode == 0, reset.stderr
    (batch, plain) = keys_cli(redis_clean, ["show", "cli-batch", "--json"], ["show", "cli-plain", "--json"])
    assert (orjson.loads(batch.stdout)["priority"], orjson.loads(plain.stdout)["priority"]) == (0, 2)


# --- a key's stored Responses API state ---


def test_deleting_a_key_deletes_its_stored_responses_and_show_usage_and_audit_name_them(redis_clean: str) -> None:
    secrets = create_keys(redis_clean, {"keeper": [], "neighbour": []})
    settings = Settings(redis_url=redis_clean)

    async def seed() -> None:
        client = connect_redis(settings)
        try:
            store, keys = ResponseStore(client, settings), KeyStore(client, settings)
            for name, count in (("keeper", 2), ("neighbour", 1)):
                owner = (await keys.get(name)).key_id
                for turn in range(count):
                    response = {"id": f"resp_{name}{turn}", "object": "response", "status": "completed", "output": []}
                    assert await store.save(owner, response, [{"role": "user", "content": "Hi"}])
        finally:
            await close_redis(client)

    asyncio.run(seed())
    shown, usage = keys_cli(redis_clean, ["show", "keeper", "--json"], ["usage", "keeper"])
    assert orjson.loads(shown.stdout)["stored_responses"]["responses"] == 2
    assert "keeper keeps 2 stored responses" in usage.stdout
    (deleted,) = keys_cli(redis_clean, ["delete", "keeper"])
    assert deleted.returncode == 0 and "its 2 stored response(s)" in deleted.stdout, deleted.stderr
    client = redis.Redis.from_url(redis_clean)
    try:
        left = sorted(name.decode() for name in client.scan_iter("nemotron:resp:*"))
        assert left == ["nemotron:resp:resp_neighbour0"]  # only the other key's
        stored = b"".join(b"".join(client.hvals(name)) for name in client.scan_iter("nemotron:resp:*"))
        assert secrets["neighbour"].encode() not in stored
    finally:
        client.close()
    (audit,) = keys_cli(redis_clean, ["audit", "keeper", "--json"])
    entries = orjson.loads(audit.stdout)
    assert [e["action"] for e in entries][-2:] == ["delete", "delete-responses"]
    assert entries[-1]["after"] == {"stored_responses_deleted": 2}
