"""Priority tiers and admission through `nemotron-gateway up` over the fake engine (real supervisor, real Redis,
real gateway workers): the key's priority reaches a priority-scheduling engine (clamped, never sent under FCFS),
and new work is refused before the engine's queue, lowest priority first, exactly across two workers."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.supervised import engine_env, status, up_process
from tests.faults.conftest import GATEWAY_ENV, create_key
from tests.procs import REPO_ROOT, free_port

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
        assert 'nemotron_gateway_priority_sent_total{field="sent",tier="2"} 3.0' in metrics


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
        assert 'nemotron_gateway_priority_sent_total{field="dropped",tier="2"} 1.0' in metrics


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
        assert 'nemotron_gateway_admission_refused_total{reason="waiting",tier="1"}' in metrics
        assert 'nemotron_gateway_engine_load{figure="waiting"}' in metrics


def test_reserved_slots_let_the_most_urgent_tier_start_at_once_while_lower_tiers_are_refused(
    tmp_path: Path, redis_url: str
) -> None:
    # Five sequence slots (the supervisor records the launched --max-num-seqs), three kept for priority 0: the
    # batch tier may hold at most two, the two urgent requests take two more, and one stays free for the
    # supervisor's liveness probe. Without the reserve five batch requests would run, one wait, and the urgent
    # ones would wait ~4 s behind them (vLLM hands a slot to a waiting request only when a running one ends).
    env = {"NEMOTRON_WORKERS": "2", "NEMOTRON_ADMISSION__RESERVED_SEQS": "3"}
    with stack(tmp_path, redis_url, ["--max-num-seqs", "5"], **env) as (gateway_url, _engine_url):
        assert status(tmp_path / "state")["sequence_slots"] == 5
        interactive, batch = key(redis_url, "--priority", "0"), key(redis_url, "--priority", "3")

        async def loads() -> tuple[list[httpx.Response], list[float]]:
            batch_burst = asyncio.ensure_future(_burst(gateway_url, batch, 6, fake_prefill_delay=4.0))
            await asyncio.sleep(1.0)
            async with httpx.AsyncClient(timeout=60) as client:

                async def timed() -> float:
                    started = time.monotonic()
                    response = await client.post(
                        f"{gateway_url}/v1/chat/completions", json=chat(fake_prefill_delay=0.2), headers=interactive
                    )
                    assert response.status_code == 200, response.text
                    return time.monotonic() - started

                urgent = await asyncio.gather(timed(), timed())
            return await batch_burst, list(urgent)

        batch_answers, urgent_seconds = asyncio.run(loads())
        codes = [r.status_code for r in batch_answers]
        assert 1 <= codes.count(200) <= 2 and codes.count(429) == 6 - codes.count(200), codes
        error = next(r for r in batch_answers if r.status_code == 429).json()["error"]
        assert error["code"] == "engine_queue_full" and "sequence slots" in error["message"]
        assert max(urgent_seconds) < 2.5, urgent_seconds
        metrics = httpx.get(f"{gateway_url}/metrics").text
        assert 'nemotron_gateway_admission_refused_total{reason="slots",tier="2"}' in metrics


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
