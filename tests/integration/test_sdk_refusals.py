"""Both SDKs, with their default retry settings, against a real gateway process (real Redis, the test engine):
every refusal raises at once or is retried after a bounded sleep, and every error on a route is in its own envelope.

The SDKs' sleeps are observed, not slept: each SDK module's clock is replaced by one that records what the SDK
computed (`_sleep_for_retry`) and returns at once, so a refusal that would hang a call for hours shows as a number.
"""

from __future__ import annotations

import time
import types
import uuid
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from anthropic import _base_client as anthropic_client
from openai import _base_client as openai_client

from tests.integration.test_keys_limits import BASE_ENV, create_keys
from tests.procs import FakeEngineControl, ServerProcess, run_gateway

pytestmark = pytest.mark.timeout(120)

MODEL = "nemotron-test"
HI = [{"role": "user", "content": "Hi"}]
NO_LIMITS = ["--rpm", "0", "--tpm", "0", "--max-concurrency", "0"]
GUARD_LIMIT = 3
ENV = {**BASE_ENV, "NEMOTRON_AUTH__FAILED_AUTH_LIMIT": str(GUARD_LIMIT)}
# The longest sleep before a retry that can still succeed: the per-minute window.
BOUND = 60.0


@pytest.fixture(scope="module")
def gateway(fake_engine: FakeEngineControl, redis_url: str) -> Iterator[ServerProcess]:
    with run_gateway(fake_engine.base_url, redis_url, env=ENV) as proc:
        yield proc


@pytest.fixture
def url(gateway: ServerProcess, engine: FakeEngineControl) -> str:
    return f"http://127.0.0.1:{gateway.port}"


def new_address() -> str:
    """A client address of its own for one test (the guard's blocks outlive a test run)."""
    return f"2001:db8::{uuid.uuid4().hex[:4]}"


def new_key(redis_url: str, *flags: str) -> str:
    """A key of its own for one test (a unique name: the gateway's key cache outlives a flush of Redis)."""
    name = f"refusals-{uuid.uuid4().hex[:8]}"
    return create_keys(redis_url, {name: list(flags)})[name]


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """What both SDKs would have slept before their retries, in order (nothing is slept)."""
    slept: list[float] = []
    clock = types.SimpleNamespace(**{name: getattr(time, name) for name in dir(time) if not name.startswith("_")})
    clock.sleep = slept.append
    monkeypatch.setattr(openai_client, "time", clock)
    monkeypatch.setattr(anthropic_client, "time", clock)
    return slept


def _sdks(url: str, key: str, address: str) -> tuple[openai.OpenAI, anthropic.Anthropic]:
    # Default max_retries on both; each test is its own client address for the failed-auth guard.
    forwarded = {"X-Forwarded-For": address}
    return (
        openai.OpenAI(base_url=f"{url}/v1", api_key=key, default_headers=forwarded, timeout=20),
        anthropic.Anthropic(base_url=url, default_headers={"x-api-key": key, **forwarded}, timeout=20),
    )


def _call_both(url: str, key: str, address: str) -> tuple[openai.APIStatusError, anthropic.APIStatusError]:
    chat, claude = _sdks(url, key, address)
    with chat, pytest.raises(openai.APIStatusError) as from_openai:
        chat.chat.completions.create(model=MODEL, messages=HI, max_tokens=4)  # type: ignore[arg-type]
    with claude, pytest.raises(anthropic.APIStatusError) as from_anthropic:
        claude.messages.create(model=MODEL, max_tokens=4, messages=HI)  # type: ignore[arg-type]
    return from_openai.value, from_anthropic.value


def test_a_spent_budget_raises_at_once_in_both_sdks_with_the_honest_retry_after(
    url: str, redis_url: str, sleeps: list[float]
) -> None:
    secret = new_key(redis_url, *[*NO_LIMITS, "--daily-tokens", "5"])
    from_openai, from_anthropic = _call_both(url, secret, new_address())
    assert sleeps == []  # no retry: before, Anthropic's SDK slept the hours until the budget's midnight
    assert isinstance(from_openai, openai.RateLimitError) and isinstance(from_anthropic, anthropic.RateLimitError)
    assert from_openai.code == "insufficient_quota"
    assert from_anthropic.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]
    for error in (from_openai, from_anthropic):
        assert error.response.headers["x-should-retry"] == "false"
        assert int(error.response.headers["retry-after"]) > BOUND  # the window's end, for clients that schedule


def test_a_blocked_address_raises_at_once_in_both_sdks(url: str, redis_url: str, sleeps: list[float]) -> None:
    address = new_address()
    with httpx.Client(timeout=10) as client:
        for _ in range(GUARD_LIMIT):
            wrong = client.post(
                f"{url}/v1/chat/completions", headers={"Authorization": "Bearer nope", "X-Forwarded-For": address}
            )
            assert wrong.status_code == 401
    from_openai, from_anthropic = _call_both(url, "sk-" + "B" * 43, address)
    assert sleeps == []
    assert isinstance(from_openai, openai.RateLimitError) and isinstance(from_anthropic, anthropic.RateLimitError)
    assert "failed authentication" in from_anthropic.message


def test_a_per_minute_limit_is_retried_by_both_sdks_after_bounded_sleeps(
    url: str, redis_url: str, sleeps: list[float]
) -> None:
    secret = new_key(redis_url, *["--rpm", "1", "--tpm", "0", "--max-concurrency", "0"])
    chat, claude = _sdks(url, secret, new_address())
    with chat, claude:
        chat.chat.completions.create(model=MODEL, messages=HI, max_tokens=4)  # type: ignore[arg-type]
    from_openai, from_anthropic = _call_both(url, secret, new_address())
    assert isinstance(from_openai, openai.RateLimitError) and isinstance(from_anthropic, anthropic.RateLimitError)
    # Each SDK retried twice (its default), each time after the gateway's Retry-After: within the window.
    assert len(sleeps) == 4 and all(0 < sleep <= BOUND for sleep in sleeps), sleeps


@pytest.mark.parametrize(
    ("status", "kind", "exception"),
    [
        (400, "invalid_request_error", anthropic.BadRequestError),
        (429, "rate_limit_error", anthropic.RateLimitError),
        (500, "api_error", anthropic.InternalServerError),
    ],
)
def test_the_engines_errors_on_the_messages_route_are_anthropics_envelope(
    url: str, redis_url: str, sleeps: list[float], status: int, kind: str, exception: type[Exception]
) -> None:
    secret = new_key(redis_url, *NO_LIMITS)
    _, claude = _sdks(url, secret, new_address())
    with claude, pytest.raises(exception) as caught:
        claude.messages.create(
            model=MODEL,
            max_tokens=4,
            messages=HI,  # type: ignore[arg-type]
            extra_body={"fake_status": status, "fake_message": "engine says"},
        )
    body: Any = caught.value.body  # type: ignore[attr-defined]
    assert body == {"type": "error", "error": {"type": kind, "message": "engine says"}}
    assert all(0 < sleep <= BOUND for sleep in sleeps), sleeps


def test_paths_and_methods_not_served_under_messages_are_anthropics_envelope(url: str, redis_url: str) -> None:
    secret = new_key(redis_url, *NO_LIMITS)
    with httpx.Client(timeout=10, headers={"x-api-key": secret}) as client:
        batches = client.post(f"{url}/v1/messages/batches", json={"requests": []})
        listed = client.get(f"{url}/v1/messages")
    assert (batches.status_code, batches.json()["error"]["type"]) == (404, "not_found_error")
    assert (listed.status_code, listed.json()["type"]) == (405, "error")
    assert listed.headers["allow"] == "POST"


def test_wrong_types_and_query_values_are_400s_in_the_routes_envelope(url: str, redis_url: str) -> None:
    secret = new_key(redis_url, *NO_LIMITS)
    # A Basic Authorization (a proxy's) in front of the key does not hide it.
    headers = {"x-api-key": secret, "Authorization": "Basic dXNlcjpwYXNz"}
    with httpx.Client(timeout=10, headers=headers) as client:
        part = {"role": "user", "content": [{"type": "input_text", "text": 7}]}
        responses = client.post(f"{url}/v1/responses", json={"model": MODEL, "input": [part]})
        counted = client.post(
            f"{url}/v1/messages/count_tokens", json={"model": MODEL, "messages": HI, "max_tokens": "many"}
        )
        stored = client.get(f"{url}/v1/responses/resp_1", params={"starting_after": "\u0661\u0662"})
    assert responses.status_code == 400 and responses.json()["error"]["param"] == "input[0].content[0].text"
    assert counted.status_code == 400 and counted.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in counted.json()["error"]["message"]
    # The store is off here: a 404 before the query is read; with it on, the query is a 400 (unit-tested).
    assert stored.status_code in (400, 404) and stored.json()["error"]["type"] == "invalid_request_error"
