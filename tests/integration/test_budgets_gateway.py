"""Token budgets, usage for billing and the audit trail end to end: two gateway processes under uvicorn sharing
real Redis, the test engine, keys made and changed by the real `keys` CLI.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import getpass
import io
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from datetime import UTC, datetime, timedelta

import httpx
import orjson
import pytest
import redis

from tests.integration.test_keys_limits import (
    BASE_ENV,
    assert_no_secret,
    auth,
    completion,
    create_keys,
    error_of,
    keys_cli,
    last_line_secret,
    redis_dump,
)
from tests.procs import FakeEngineControl, ServerProcess, run_gateway, wait_until

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def gateways(fake_engine: FakeEngineControl, redis_url: str) -> Iterator[list[ServerProcess]]:
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(run_gateway, fake_engine.base_url, redis_url, env=BASE_ENV) for _ in range(2)]
        wait(futures)
    with contextlib.ExitStack() as stack:
        started = [stack.enter_context(f.result()) for f in futures if f.exception() is None]
        for future in futures:
            if (error := future.exception()) is not None:
                raise error
        yield started


@pytest.fixture
def urls(gateways: list[ServerProcess], engine: FakeEngineControl) -> list[str]:
    return [f"http://127.0.0.1:{proc.port}" for proc in gateways]


NO_LIMITS = ["--rpm", "0", "--tpm", "0", "--max-concurrency", "0"]


def _seconds_to_utc_midnight() -> float:
    now = datetime.now(UTC)
    return (datetime.combine(now.date() + timedelta(days=1), datetime.min.time(), UTC) - now).total_seconds()


def _budget_used(redis_url: str, name: str) -> int:
    client = redis.Redis.from_url(redis_url, socket_timeout=5.0)
    try:
        day = datetime.now(UTC).strftime("%Y%m%d")
        return int(client.get(f"nemotron:rl:{{{name}}}:budget:d{day}") or 0)
    finally:
        client.close()


def test_a_spent_budget_is_a_429_insufficient_quota_with_retry_after_to_the_window_end(
    urls: list[str], redis_clean: str
) -> None:
    secret = create_keys(redis_clean, {"spender": [*NO_LIMITS, "--daily-tokens", "50", "--monthly-tokens", "1000"]})
    headers = auth(secret["spender"], "198.51.100.20")
    with httpx.Client(timeout=10) as client:
        for index in range(5):  # "hi" + max_tokens 9: 10 tokens charged, 10 reported by the test engine
            response = client.post(f"{urls[index % 2]}/v1/completions", json=completion("hi", 9), headers=headers)
            assert response.status_code == 200, response.text
            assert response.headers["x-budget-remaining-tokens-day"] == str(50 - 10 * (index + 1))
            assert response.headers["x-budget-remaining-tokens-month"] == str(1000 - 10 * (index + 1))
            assert response.headers["x-budget-limit-tokens-day"] == "50"
        to_midnight_before = _seconds_to_utc_midnight()
        refused = client.post(f"{urls[1]}/v1/completions", json=completion("hi", 9), headers=headers)
        to_midnight_after = _seconds_to_utc_midnight()
    assert refused.status_code == 429, refused.text
    error = error_of(refused)
    assert error["type"] == "insufficient_quota" and error["code"] == "insufficient_quota", error
    assert "daily token budget (50; 0 left" in error["message"], error["message"]
    retry_after = int(refused.headers["retry-after"])
    # Until midnight as the gateway read its clock while answering, in whole seconds (rounded up).
    assert to_midnight_after <= retry_after <= to_midnight_before + 1, retry_after
    assert refused.headers["x-budget-remaining-tokens-day"] == "0"
    assert refused.headers["x-budget-remaining-tokens-month"] == "950"
    shown, listed = keys_cli(redis_clean, ["show", "spender"], ["show", "spender", "--json"])
    assert "tokens/day:      50 (used 50)" in shown.stdout and "tokens/month:    1000 (used 50)" in shown.stdout
    row = orjson.loads(listed.stdout)
    assert row["limits"]["daily_tokens"] == 50 and row["budget_used"] == {"day": 50, "month": 50}


async def test_a_budget_holds_across_two_gateways_under_concurrent_load(urls: list[str], redis_clean: str) -> None:
    budget = 300
    secret = create_keys(redis_clean, {"shared": [*NO_LIMITS, "--daily-tokens", str(budget)]})["shared"]
    headers = auth(secret, "198.51.100.21")
    # Three 40-character words: charged 31 + 9 = 40 up front, reconciled to the 3 + 9 = 12 the engine reports.
    body = completion(" ".join(["x" * 40] * 3), 9, fake_token_delay=0.01)
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=60)) as client:
        responses = await asyncio.gather(
            *(client.post(f"{urls[index % 2]}/v1/completions", json=body, headers=headers) for index in range(60))
        )
        # Late requests fit once early ones are reconciled: keep going until the budget is spent.
        for _ in range(30):
            more = await client.post(f"{urls[0]}/v1/completions", json=body, headers=headers)
            responses.append(more)
            if more.status_code == 429:
                break
    served = [response for response in responses if response.status_code == 200]
    refused = [response for response in responses if response.status_code != 200]
    assert refused and {error_of(response)["code"] for response in refused} == {"insufficient_quota"}
    charged = sum(response.json()["usage"]["total_tokens"] for response in served)
    assert charged == 12 * len(served) <= budget
    # The rule: a request is admitted only while its up-front 40 fits, so at most 40 - 1 tokens stay unused.
    assert charged > budget - 40
    assert _budget_used(redis_clean, "shared") == charged


def test_a_budget_change_reaches_every_gateway(urls: list[str], redis_clean: str) -> None:
    secret = create_keys(redis_clean, {"changing": [*NO_LIMITS, "--daily-tokens", "1000"]})["changing"]
    headers = auth(secret, "198.51.100.22")
    with httpx.Client(timeout=10) as client:
        for url in urls:  # both gateways have the key cached
            assert client.post(f"{url}/v1/completions", json=completion("hi", 9), headers=headers).status_code == 200
        (below,) = keys_cli(redis_clean, ["set", "changing", "--daily-tokens", "15"])
        assert below.returncode == 2, below.stderr
        assert "below the 20 tokens 'changing' already used this day" in below.stderr and "--force" in below.stderr
        (forced,) = keys_cli(redis_clean, ["set", "changing", "--daily-tokens", "15", "--force"])
        assert forced.returncode == 0, forced.stderr
        for url in urls:
            wait_until(
                lambda url=url: (
                    client.post(f"{url}/v1/completions", json=completion("hi", 9), headers=headers).status_code == 429
                ),
                timeout=30,
            )


def test_nonsense_budget_flags_are_clear_cli_errors(redis_clean: str) -> None:
    create_keys(redis_clean, {"flags": []})
    results = keys_cli(
        redis_clean,
        ["set", "flags", "--daily-tokens", "abc"],
        ["set", "flags", "--monthly-tokens=-5"],
        ["create", "--name", "flags2", "--daily-tokens", "1.5"],
    )
    for result in results:
        assert result.returncode == 2, result
        assert "expected a whole number" in result.stderr or "limits are 0 (unlimited) or more" in result.stderr, (
            result.stderr
        )
        assert "Traceback" not in result.stderr
    assert "--daily-tokens" in results[0].stderr and "'abc'" in results[0].stderr


def test_usage_cli_reports_requests_and_tokens_by_day_and_api(urls: list[str], redis_clean: str) -> None:
    secret = create_keys(redis_clean, {"billed": NO_LIMITS})["billed"]
    headers = auth(secret, "198.51.100.23")
    chat = {"model": "nemotron-test", "messages": [{"role": "user", "content": "one two"}], "max_tokens": 4}
    with httpx.Client(timeout=10) as client:
        for url in urls:
            assert client.post(f"{url}/v1/completions", json=completion("a b c", 5), headers=headers).status_code == 200
            assert client.post(f"{url}/v1/chat/completions", json=chat, headers=headers).status_code == 200
    as_json, as_csv, table = keys_cli(
        redis_clean, ["usage", "billed", "--json"], ["usage", "--csv"], ["usage", "billed", "--since", "2026-01-01"]
    )
    assert as_json.returncode == 0, as_json.stderr
    rows = orjson.loads(as_json.stdout)
    today = datetime.now(UTC).date().isoformat()
    by_api = {row["api"]: row for row in rows}
    assert set(by_api) == {"completions", "chat"}
    assert {row["model"] for row in rows} == {"nemotron-test"}, "each row names the model that served it"
    completions = by_api["completions"]
    assert completions["day"] == today and completions["key"] == "billed"
    assert (completions["requests"], completions["prompt_tokens"], completions["completion_tokens"]) == (2, 6, 10)
    assert completions["tokens"] == 16
    assert by_api["chat"]["requests"] == 2 and by_api["chat"]["completion_tokens"] == 8
    parsed = list(csv.DictReader(io.StringIO(as_csv.stdout)))
    assert {(row["key"], row["api"], row["model"], row["requests"]) for row in parsed} == {
        ("billed", "completions", "nemotron-test", "2"),
        ("billed", "chat", "nemotron-test", "2"),
    }
    assert table.returncode == 0 and "chat" in table.stdout and today in table.stdout
    (bad,) = keys_cli(redis_clean, ["usage", "--since", "yesterday"])
    assert bad.returncode == 2 and "expected a date as YYYY-MM-DD" in bad.stderr


def test_audit_cli_records_each_verb_with_its_operator_and_never_the_secret(urls: list[str], redis_clean: str) -> None:
    created = keys_cli(redis_clean, ["create", "--name", "trail", "--daily-tokens", "100"])[0]
    secrets = [last_line_secret(created)]
    (changed,) = keys_cli(redis_clean, ["set", "trail", "--monthly-tokens", "5000", "--operator", "carol"])
    assert changed.returncode == 0, changed.stderr
    (rotated,) = keys_cli(redis_clean, ["rotate", "trail", "--operator", "carol"])
    secrets.append(last_line_secret(rotated))
    (revoked,) = keys_cli(redis_clean, ["revoke", "trail", "--operator", "dave"])
    assert revoked.returncode == 0, revoked.stderr
    (deleted,) = keys_cli(redis_clean, ["delete", "trail", "--operator", "dave"])
    assert deleted.returncode == 0, deleted.stderr
    as_json, text = keys_cli(redis_clean, ["audit", "trail", "--json"], ["audit"])
    entries = orjson.loads(as_json.stdout)
    assert [(e["action"], e["operator"]) for e in entries] == [
        ("create", getpass.getuser()),
        ("set", "carol"),
        ("rotate", "carol"),
        ("revoke", "dave"),
        ("delete", "dave"),
    ]
    assert entries[1]["before"] == {"limits.monthly_tokens": None}
    assert entries[1]["after"] == {"limits.monthly_tokens": 5000}
    assert entries[2]["after"] == {"prefix": secrets[1][:9]}
    assert "limits.monthly_tokens: null -> 5000" in text.stdout and "dave  revoke  trail" in text.stdout
    for blob, where in (
        (as_json.stdout, "audit json"),
        (text.stdout, "audit text"),
        (redis_dump(redis_clean), "Redis"),
    ):
        assert_no_secret(blob, secrets, where)


def test_budgets_are_in_metrics_and_go_with_a_revoked_key(urls: list[str], redis_clean: str) -> None:
    secret = create_keys(redis_clean, {"metered": [*NO_LIMITS, "--daily-tokens", "500"]})["metered"]
    headers = auth(secret, "198.51.100.24")
    with httpx.Client(timeout=10) as client:
        assert client.post(f"{urls[0]}/v1/completions", json=completion("hi", 9), headers=headers).status_code == 200
        scrape = client.get(f"{urls[0]}/metrics").text
        assert 'nemotron_gateway_key_budget_tokens{key="metered",window="day"} 500.0' in scrape
        assert 'nemotron_gateway_key_budget_used_tokens{key="metered",window="day"} 10.0' in scrape
        assert 'key="metered",window="month"' not in scrape  # no monthly budget: no series
        assert keys_cli(redis_clean, ["revoke", "metered"])[0].returncode == 0
        wait_until(lambda: 'key="metered"' not in client.get(f"{urls[0]}/metrics").text, timeout=3)


# A request that leaves its length to the engine (the OpenAI SDK's default), for a model that would go on for
# 2,000 tokens: the test engine stops it there, or at the length the gateway sent.
_LONG_ANSWER = {"fake_eos_after": 2000}
_UNCAPPED = {
    "chat": ("/v1/chat/completions", {"model": "nemotron-test", "messages": [{"role": "user", "content": "hi"}]}),
    "completions": ("/v1/completions", {"model": "nemotron-test", "prompt": "hi"}),
    "responses": ("/v1/responses", {"model": "nemotron-test", "input": "hi", "store": False}),
}


def _usage_total(answer: dict[str, object]) -> int:
    usage = answer["usage"]
    assert isinstance(usage, dict), answer
    return int(usage["total_tokens"])


@pytest.mark.parametrize(
    ("api", "limit"),
    [
        ("chat", "--daily-tokens"),
        ("completions", "--monthly-tokens"),
        ("responses", "--daily-tokens"),
        ("chat", "--tpm"),
    ],
    ids=["chat-daily", "completions-monthly", "responses-daily", "chat-tpm"],
)
def test_a_request_leaving_its_length_to_the_engine_cannot_go_past_the_keys_token_limit(
    urls: list[str], redis_clean: str, api: str, limit: str
) -> None:
    limits = ["--rpm", "0", "--max-concurrency", "0", *(["--tpm", "0"] if limit != "--tpm" else [])]
    name = f"open-{api}-{limit.strip('-')}"
    secret = create_keys(redis_clean, {name: [*limits, limit, "300"]})[name]
    path, body = _UNCAPPED[api]
    with httpx.Client(timeout=30) as client:
        answer = client.post(f"{urls[0]}{path}", json={**body, **_LONG_ANSWER}, headers=auth(secret, "198.51.100.40"))
    assert answer.status_code == 200, answer.text
    # Without a cap the engine would have generated 2,000 tokens on a 300-token limit.
    assert _usage_total(answer.json()) <= 300
    if limit == "--daily-tokens":
        assert _budget_used(redis_clean, name) <= 300


def test_a_budget_near_its_end_serves_a_length_left_to_the_engine_with_what_is_left(
    urls: list[str], redis_clean: str
) -> None:
    secret = create_keys(redis_clean, {"nearly-spent": [*NO_LIMITS, "--daily-tokens", "300"]})["nearly-spent"]
    headers = auth(secret, "198.51.100.41")
    path, body = _UNCAPPED["chat"]
    with httpx.Client(timeout=30) as client:
        first = client.post(f"{urls[0]}/v1/completions", json=completion("hi", 200), headers=headers)
        assert first.status_code == 200, first.text
        left = 300 - _budget_used(redis_clean, "nearly-spent")
        assert 0 < left < 300
        # The whole budget no longer fits the request: its length is what the budget has left, not a refusal.
        served = client.post(f"{urls[1]}{path}", json={**body, **_LONG_ANSWER}, headers=headers)
        assert served.status_code == 200, served.text
        assert _usage_total(served.json()) <= left
        assert served.json()["choices"][0]["finish_reason"] == "length"
        assert _budget_used(redis_clean, "nearly-spent") <= 300
        # Spent to the last token that a prompt leaves room for: refused, as before.
        spent = client.post(f"{urls[0]}{path}", json={**body, **_LONG_ANSWER}, headers=headers)
    assert spent.status_code == 429, spent.text
    assert error_of(spent)["type"] == "insufficient_quota"
