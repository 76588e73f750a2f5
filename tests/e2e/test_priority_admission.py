"""Priority tiers and admission through `nemotron-gateway up` over the fake engine (real supervisor, real Redis,
real gateway workers): the key's priority reaches a priority-scheduling engine (clamped, never sent under FCFS),
and new work is refused before the engine's queue, lowest priority first, exactly across two workers."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.supervised import engine_env, status, up_process
from tests.faults.conftest import GATEWAY_ENV, create_key
from tests.procs import REPO_ROOT, async_wait_until, free_port

pytestmark = pytest.mark.timeout(120)

MODEL = "nemotron"


@contextmanager
def stack(tmp_path: Path, redis_url: str, engine_args: list[str], **env: str) -> Iterator[tuple[str, str]]:
    """`up` over the fake engine launched with `engine_args`: (gateway URL, engine URL)."""
    engine_port, gateway_port = free_port(), free_port()
    full_env = engine_env(
        tmp_path / "state",
        engine_port,
        NEMOTRON_PORT=str(gateway_port),
        NEMOTRON_REDIS_URL=redis_url,
        NEMOTRON_ENGINE__EXTRA_ARGS=json.dumps(engine_args),
        # A test's queue must not be another test's: each stack names its own engine in Redis.
        NEMOTRON_ADMISSION__ENGINE_ID=uuid.uuid4().hex,
        **GATEWAY_ENV,
        **env,
    )
    with up_process(full_env, gateway_port).start():
        yield f"http://127.0.0.1:{gateway_port}", f"http://127.0.0.1:{engine_port}"


def key(redis_url: str, *flags: str, name: str | None = None) -> dict[str, str]:
    secret = create_key(redis_url, name or f"prio-{uuid.uuid4().hex[:8]}", 100, *flags)
    return {"Authorization": f"Bearer {secret}"}


def requests_used(redis_url: str, name: str) -> int:
    """The key's requests today as `nemotron-gateway keys usage NAME --json` reports them (billing's view)."""
    argv = [sys.executable, "-m", "gateway", "keys", "usage", name, "--json", "--redis-url", redis_url]
    done = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, check=True)
    return sum(int(row["requests"]) for row in json.loads(done.stdout))


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **extra}


def received_priority(engine_url: str, request_id: str) -> object:
    """The `priority` the engine received with the request sent as `request_id` (the gateway adds a suffix)."""
    records = httpx.get(f"{engine_url}/_test/requests").json()
    (body,) = [r["body"] for r in records if (r["request_id"] or "").startswith(request_id)]
    return body.get("priority", "absent")


def send(gateway_url: str, headers: dict[str, str], **extra: Any) -> tuple[httpx.Response, str]:
    request_id = uuid.uuid4().hex
    response = httpx.post(
        f"{gateway_url}/v1/chat/completions", json=chat(**extra), headers={**headers, "X-Request-Id": request_id}
    )
    return response, request_id


def test_a_priority_engine_gets_the_keys_priority_and_a_client_can_only_ask_for_less(
    tmp_path: Path, redis_url: str
) -> None:
    with stack(tmp_path, redis_url, ["--scheduling-policy", "priority"]) as (gateway_url, engine_url):
        assert status(tmp_path / "state")["scheduling_policy"] == "priority"
        batch = key(redis_url, "--priority", "5")
        response, request_id = send(gateway_url, batch)
        assert response.status_code == 200, response.text
        assert received_priority(engine_url, request_id) == 5
        # More urgent than the key: clamped to the key's; less urgent: taken.
        response, request_id = send(gateway_url, batch, priority=0)
        assert (response.status_code, received_priority(engine_url, request_id)) == (200, 5)
        response, request_id = send(gateway_url, batch, priority=9)
        assert (response.status_code, received_priority(engine_url, request_id)) == (200, 9)
        # A key without its own priority gets NEMOTRON_LIMITS__DEFAULT_PRIORITY (0).
        response, request_id = send(gateway_url, key(redis_url))
        assert (response.status_code, received_priority(engine_url, request_id)) == (200, 0)
        response, _ = send(gateway_url, batch, priority="high")
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "priority"
        metrics = httpx.get(f"{gateway_url}/metrics").text
        assert re.search(
            r'nemotron_gateway_priority_sent_total\{field="sent",model="[^"]+",replica="[^"]+",tier="2"\} 3\.0', metrics
        )


def test_an_fcfs_engine_never_gets_a_priority(tmp_path: Path, redis_url: str) -> None:
    with stack(tmp_path, redis_url, []) as (gateway_url, engine_url):
        assert status(tmp_path / "state")["scheduling_policy"] == "fcfs"
        batch = key(redis_url, "--priority", "5")
        # The engine itself refuses a non-zero priority under FCFS...
        direct = httpx.post(f"{engine_url}/v1/chat/completions", json=chat(priority=5))
        assert direct.status_code == 400
        # ...so the gateway sends none: the key's and the client's own are dropped.
        response, request_id = send(gateway_url, batch, priority=7)
        assert response.status_code == 200, response.text
        assert received_priority(engine_url, request_id) == "absent"
        metrics = httpx.get(f"{gateway_url}/metrics").text
        assert re.search(
            r'nemotron_gateway_priority_sent_total\{field="dropped",model="[^"]+",replica="[^"]+",tier="2"\} 1\.0',
            metrics,
        )


async def _burst(gateway_url: str, headers: dict[str, str], count: int, **extra: Any) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=60) as client:
        return await asyncio.gather(
            *(
                client.post(f"{gateway_url}/v1/chat/completions", json=chat(**extra), headers=headers)
                for _ in range(count)
            )
        )


def test_admission_refuses_lowest_priority_first_exactly_across_two_workers(tmp_path: Path, redis_url: str) -> None:
    # One sequence runs at a time, each for ~1.5 s: everything else waits in the engine's queue. Bound 4: the
    # most urgent tier may fill it, tier 1 (share 0.25) only one place.
    env = {
        "NEMOTRON_WORKERS": "2",
        "NEMOTRON_ADMISSION__MAX_WAITING": "4",
        "NEMOTRON_ADMISSION__SHARES": "[1.0, 0.25]",
    }
    with stack(tmp_path, redis_url, ["--max-num-seqs", "1"], **env) as (gateway_url, engine_url):
        batch_name = f"prio-{uuid.uuid4().hex[:8]}"
        interactive = key(redis_url, "--priority", "0")
        batch = key(redis_url, "--priority", "1", name=batch_name)
        slow = {"fake_prefill_delay": 1.5}
        batch_answers = asyncio.run(_burst(gateway_url, batch, 6, **slow))
        refused = [r for r in batch_answers if r.status_code == 429]
        assert refused, [r.status_code for r in batch_answers]
        # A request refused before the engine is no request of the key (nor of its requests/min): not in its usage.
        assert requests_used(redis_url, batch_name) == 6 - len(refused)
        error = refused[0].json()["error"]
        assert (error["type"], error["code"]) == ("rate_limit_error", "engine_queue_full")
        assert 1 <= int(refused[0].headers["Retry-After"]) <= 30
        # While the engine is busy with the batch tier, the most urgent tier is still admitted, up to the bound,
        # and the engine's queue never grows past it, whichever worker admitted what.
        answers = asyncio.run(_burst(gateway_url, interactive, 12, **slow))
        assert any(r.status_code == 200 for r in answers), [r.status_code for r in answers]
        assert any(r.status_code == 429 for r in answers), [r.status_code for r in answers]
        peak = httpx.get(f"{engine_url}/_test/stats").json()["peak_waiting"]
        assert peak <= 4
        metrics = httpx.get(f"{gateway_url}/metrics").text
        assert re.search(
            r'nemotron_gateway_admission_refused_total\{model="[^"]+",reason="waiting",replica="[^"]+",tier="1"\} '
            r"[1-9]",
            metrics,
        )
        assert re.search(r'nemotron_gateway_engine_load\{figure="waiting",model="[^"]*",replica="[^"]+"\}', metrics)


# The batch tier's requests would hold their sequence slots for longer than an urgent client waits: an urgent
# request that had to wait for one of them to end could not be answered at all (httpx.ReadTimeout), only one that
# started at once.
BATCH_PREFILL = 600.0
URGENT_CLIENT_TIMEOUT = 30.0
# The urgent tier's answer beside the batch flood (a 0.2 s prefill, max_tokens 1): typically well under a second.
URGENT_BOUND = 5.0


@dataclass
class ReserveRun:
    refused: list[httpx.Response]  # the batch tier's answers (the rest of its six requests are at the engine)
    admitted: int  # batch requests the engine got
    urgent_seconds: list[float]  # each urgent request's answer, from its send
    metrics: str


def _reserve_run(tmp_path: Path, redis_url: str) -> ReserveRun:
    """Five sequence slots, three kept for priority 0; six batch requests (priority 3), then two urgent ones."""
    env = {"NEMOTRON_WORKERS": "2", "NEMOTRON_ADMISSION__RESERVED_SEQS": "3"}
    with stack(tmp_path, redis_url, ["--max-num-seqs", "5"], **env) as (gateway_url, engine_url):
        assert status(tmp_path / "state")["sequence_slots"] == 5
        interactive, batch = key(redis_url, "--priority", "0"), key(redis_url, "--priority", "3")
        url = f"{gateway_url}/v1/chat/completions"

        async def run() -> ReserveRun:
            async with httpx.AsyncClient(timeout=60) as client:

                async def batch_at_engine() -> int:
                    records = (await client.get(f"{engine_url}/_test/requests")).json()
                    return sum(r["body"].get("fake_prefill_delay") == BATCH_PREFILL for r in records)

                flood = chat(fake_prefill_delay=BATCH_PREFILL)
                batch_posts = [asyncio.create_task(client.post(url, json=flood, headers=batch)) for _ in range(6)]
                # Every batch request judged (answered, or running at the engine) before the urgent ones are sent.
                admitted = 0

                async def all_judged() -> bool:
                    nonlocal admitted
                    admitted = await batch_at_engine()
                    return admitted + sum(post.done() for post in batch_posts) == 6

                await async_wait_until(all_judged, within=30, interval=0.1, message="batch requests not judged")

                async def urgent() -> float:
                    started = time.monotonic()
                    response = await client.post(
                        url, json=chat(fake_prefill_delay=0.2), headers=interactive, timeout=URGENT_CLIENT_TIMEOUT
                    )
                    assert response.status_code == 200, response.text
                    return time.monotonic() - started

                urgent_seconds = list(await asyncio.gather(urgent(), urgent()))
                refused = [post.result() for post in batch_posts if post.done()]
                for post in batch_posts:
                    post.cancel()
                await asyncio.gather(*batch_posts, return_exceptions=True)
                metrics = (await client.get(f"{gateway_url}/metrics")).text
            return ReserveRun(refused, admitted, urgent_seconds, metrics)

        return asyncio.run(run())


def test_reserved_slots_let_the_most_urgent_tier_start_at_once_while_lower_tiers_are_refused(
    tmp_path: Path, redis_url: str
) -> None:
    # The batch tier may hold at most two of the five slots, the two urgent requests take two more, and one stays
    # free for the supervisor's liveness probe. Without the reserve five batch requests would run, one wait, and
    # the urgent ones would wait behind them (vLLM hands a slot to a waiting request only when a running one ends):
    # here for longer than their client's timeout.
    outcome = _reserve_run(tmp_path, redis_url)
    assert 1 <= outcome.admitted <= 2 and len(outcome.refused) == 6 - outcome.admitted, outcome
    assert [r.status_code for r in outcome.refused] == [429] * len(outcome.refused)
    error = outcome.refused[0].json()["error"]
    assert error["code"] == "engine_queue_full" and "sequence slots" in error["message"]
    assert re.search(
        r'nemotron_gateway_admission_refused_total\{model="[^"]+",reason="slots",replica="[^"]+",tier="2"\} [1-9]',
        outcome.metrics,
    )


@pytest.mark.perf
def test_the_urgent_tier_is_answered_promptly_beside_a_batch_flood(tmp_path: Path, redis_url: str) -> None:
    outcome = _reserve_run(tmp_path, redis_url)
    assert max(outcome.urgent_seconds) < URGENT_BOUND, outcome.urgent_seconds


def test_a_full_kv_cache_is_a_503_and_vllms_own_refusal_keeps_the_envelope(tmp_path: Path, redis_url: str) -> None:
    env = {"NEMOTRON_ADMISSION__MAX_KV_CACHE_USE": "0.9", "NEMOTRON_ADMISSION__SHARES": "[1.0, 0.5]"}
    with stack(tmp_path, redis_url, [], **env) as (gateway_url, engine_url):
        httpx.post(f"{engine_url}/_test/load", json={"kv_cache": 0.6})
        batch, interactive = key(redis_url, "--priority", "1"), key(redis_url)
        # Tier 1 is refused from 0.45 of the cache, tier 0 only from 0.9: once a scrape shows 0.6, only tier 1.
        for _ in range(100):
            response, _ = send(gateway_url, batch)
            if response.status_code == 503:
                break
            asyncio.run(asyncio.sleep(0.1))
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "engine_busy"
        assert int(response.headers["Retry-After"]) >= 1
        assert send(gateway_url, interactive)[0].status_code == 200
        # vLLM's own --max-num-queued-reqs answers 503 in its own shape: the gateway's envelope instead.
        response, _ = send(gateway_url, interactive, fake_status=503)
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "engine_busy"
        assert "Retry-After" in response.headers
