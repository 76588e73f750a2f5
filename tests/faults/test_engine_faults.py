"""Engine faults under live traffic: the engine's process group SIGKILLed with streams open (under the real
supervisor, `nemotron-gateway up`), and the engine's API server frozen with SIGSTOP.

A frozen engine core on the real CPU vLLM is tested in the engine tier (tests/engine/), not here.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from gateway.supervisor.process import group_members, remove_files, shared_memory_of
from tests.e2e.supervised import engine_env, status, up_process
from tests.faults.conftest import (
    GATEWAY_ENV,
    MODEL,
    Figures,
    StreamOutcome,
    assert_ended_with_one_error,
    chat_body,
    create_key,
    gateway_on,
    in_flight,
    in_flight_settled,
    lease_count,
    read_stream,
)
from tests.procs import FakeEngineControl, ServerProcess, async_wait_until, free_port, run_fake_engine

pytestmark = [pytest.mark.faults, pytest.mark.timeout(120)]

STREAMS = 8
# A frozen engine's streams can end only by the gateway's finding that it stopped generating (the relay's
# documented bound: max(stall_timeout, generation_probe_timeout + 2 x probe_interval) + probe_interval, 15.2 s with
# the defaults and this tier's 0.2 s probe interval; tests/integration/test_engine_faults_gateway.py times it): the
# chunk timeout is past the test's own, and the clients wait no longer than this.
STALL_WAIT = 60.0
# A refused answer while the engine is down: no waiting on a dead engine (typically milliseconds).
FAST_503 = 5.0


@dataclass
class UpStack:
    proc: ServerProcess
    url: str
    state_dir: Path
    key_name: str
    headers: dict[str, str]
    redis_url: str


@pytest.fixture
def up_stack(tmp_path: Path, redis_url: str) -> Iterator[UpStack]:
    """`nemotron-gateway up` with keys on; its engine is the fake one, with an EngineCore-like helper child."""
    state_dir = tmp_path / "state"
    engine_port, gateway_port = free_port(), free_port()
    key_name = f"fault-up-{uuid.uuid4().hex[:8]}"
    secret = create_key(redis_url, key_name)
    env = engine_env(
        state_dir,
        engine_port,
        NEMOTRON_PORT=str(gateway_port),
        NEMOTRON_REDIS_URL=redis_url,
        NEMOTRON_ENGINE__EXTRA_ARGS='["--spawn-child"]',
        # Long enough that the engine is still down when the first request after the kill arrives.
        NEMOTRON_ENGINE__BACKOFF_INITIAL="0.5",
        **GATEWAY_ENV,
    )
    proc = up_process(env, gateway_port)
    with proc.start():
        headers = {"Authorization": f"Bearer {secret}"}
        yield UpStack(proc, f"http://127.0.0.1:{gateway_port}", state_dir, key_name, headers, redis_url)


async def start_streams(
    client: httpx.AsyncClient, url: str, headers: dict[str, str], count: int
) -> list[asyncio.Task[StreamOutcome]]:
    """`count` long streams, returned once each has delivered a token."""
    started = [asyncio.Event() for _ in range(count)]
    tasks = [asyncio.create_task(read_stream(client, url, headers, chat_body(), event)) for event in started]
    await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 30)
    assert not any(task.done() for task in tasks), [task.result() for task in tasks if task.done()]
    return tasks


async def poll_until_served(
    client: httpx.AsyncClient, url: str, headers: dict[str, str], within: float
) -> tuple[float, list[tuple[httpx.Response, float]]]:
    """Send small requests back to back until one is answered 200: (when, each refusal and its latency)."""
    refusals: list[tuple[httpx.Response, float]] = []
    deadline = time.monotonic() + within
    body = chat_body(stream=False, max_tokens=1, token_delay=0)
    while time.monotonic() < deadline:
        sent = time.monotonic()
        response = await client.post(url, json=body, headers=headers)
        if response.status_code == 200:
            return time.monotonic(), refusals
        refusals.append((response, time.monotonic() - sent))
        await asyncio.sleep(0.05)
    raise AssertionError(f"not served again within {within} s; last answers: {[r.text for r, _ in refusals[-3:]]}")


def assert_503s(refusals: list[tuple[httpx.Response, float]]) -> None:
    for response, _ in refusals:
        assert response.status_code == 503, response.text
        assert response.headers.get("retry-after", "").isdigit(), response.headers
        assert response.json()["error"]["type"] == "service_unavailable"


def engine_server_pid(group: int) -> int:
    """The fake `vllm serve` process in the engine's group (not the guard, not its helper child)."""
    for pid in group_members(group):
        with contextlib.suppress(OSError):
            # The guard's own argv names the engine's too, after `--`.
            if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[1:3] == [b"-m", b"tests.fakes.fake_engine"]:
                return pid
    raise AssertionError(f"no engine server among {group_members(group)}")


@pytest.mark.parametrize("target", ["group", "server"])
async def test_engine_sigkill_with_streams_open(up_stack: UpStack, figures: Figures, target: str) -> None:
    """`group`: every process of the engine at once (the guard too); `server`: vllm serve alone (an OOM kill)."""
    url = f"{up_stack.url}/v1/chat/completions"
    # An earlier test's engine restart may still be under way: its status names no engine until it has one.
    engine_pid = await async_wait_until(
        lambda: status(up_stack.state_dir).get("engine_pid"), within=60, message="no engine in the status file"
    )
    group = os.getpgid(int(str(engine_pid)))
    held = shared_memory_of(group_members(group))
    assert held, "the fake engine's helper holds a /dev/shm file, as vLLM's EngineCore does"
    baseline = in_flight(up_stack.url)
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(30.0, connect=5.0)) as client:
            streams = await start_streams(client, url, up_stack.headers, STREAMS)
            killed_at = time.monotonic()
            if target == "group":
                os.killpg(group, signal.SIGKILL)
            else:
                os.kill(engine_server_pid(group), signal.SIGKILL)
            outcomes = await asyncio.wait_for(asyncio.gather(*streams), 30)
            recovered_at, refusals = await poll_until_served(client, url, up_stack.headers, within=30)
        for index, outcome in enumerate(outcomes):
            assert_ended_with_one_error(outcome, f"stream {index}")
        # A request held until the engine was back would have been answered 200, not refused.
        assert refusals, "the first request after the kill found the engine up already"
        assert_503s(refusals)
        prefix = f"engine_sigkill_{target}"
        figures(f"{prefix}.streams_ended_after_kill_s", max(o.ended_at for o in outcomes) - killed_at, "s")
        figures(f"{prefix}.recovery_s", recovered_at - killed_at, "s", "kill to first 200, restart backoff 0.5 s")
        figures(f"{prefix}.503s_while_down", len(refusals), "requests", "sent back to back, 50 ms apart")
        await async_wait_until(lambda: not group_members(group), within=10, message="the killed group left processes")
        await async_wait_until(
            lambda: not [path for path in held if Path(path).exists()],
            within=10,
            message=f"/dev/shm files of the killed engine survived: {sorted(held)}",
        )
        await async_wait_until(
            lambda: lease_count(up_stack.redis_url, up_stack.key_name) == 0, within=5, message="a slot leaked"
        )
        await async_wait_until(lambda: in_flight_settled(up_stack.url, baseline), within=5, message="in-flight leaked")
        # The gateway may be served before the supervisor's own probe has seen the new engine ready.
        await async_wait_until(lambda: status(up_stack.state_dir).get("state") == "ready", within=10)
        assert status(up_stack.state_dir)["restarts"] == 1
    finally:
        remove_files(held)  # a failed run leaves nothing behind either


@pytest.mark.perf
async def test_a_killed_engine_is_refused_promptly(up_stack: UpStack) -> None:
    url = f"{up_stack.url}/v1/chat/completions"
    # An earlier test's engine restart may still be under way: its status names no engine until it has one.
    engine_pid = await async_wait_until(
        lambda: status(up_stack.state_dir).get("engine_pid"), within=60, message="no engine in the status file"
    )
    group = os.getpgid(int(str(engine_pid)))
    held = shared_memory_of(group_members(group))
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(30.0, connect=5.0)) as client:
            os.killpg(group, signal.SIGKILL)
            _, refusals = await poll_until_served(client, url, up_stack.headers, within=30)
        assert refusals, "the first request after the kill found the engine up already"
        slowest = max(elapsed for _, elapsed in refusals)
        assert slowest < FAST_503, f"a 503 took {slowest:.2f} s"
        await async_wait_until(lambda: not group_members(group), within=10, message="the killed group left processes")
    finally:
        remove_files(held)


async def test_engine_api_server_sigstop_then_sigcont(redis_url: str, figures: Figures) -> None:
    with run_fake_engine(model=MODEL) as engine_proc:
        engine = FakeEngineControl(engine_proc)
        with gateway_on(engine, redis_url, NEMOTRON_RELAY__CHUNK_TIMEOUT="600") as gateway:
            url = f"{gateway.url}/v1/chat/completions"
            baseline = in_flight(gateway.url)
            async with httpx.AsyncClient(timeout=httpx.Timeout(STALL_WAIT, connect=5.0)) as client:
                streams = await start_streams(client, url, gateway.headers, 4)
                stopped_at = time.monotonic()
                engine_proc.send_signal(signal.SIGSTOP)
                try:
                    outcomes = await asyncio.wait_for(asyncio.gather(*streams), STALL_WAIT)
                    refused_at = await first_refusal(client, url, gateway.headers, stopped_at + STALL_WAIT)
                finally:
                    engine_proc.send_signal(signal.SIGCONT)
                continued_at = time.monotonic()
                recovered_at, refusals = await poll_until_served(client, url, gateway.headers, within=30)
            for index, outcome in enumerate(outcomes):
                assert_ended_with_one_error(outcome, f"stream {index}")
                assert "stopped generating" in outcome.errors[0]["message"], outcome.errors
            assert_503s(refusals)
            figures("engine_sigstop.streams_ended_after_stop_s", max(o.ended_at for o in outcomes) - stopped_at, "s")
            figures("engine_sigstop.first_503_after_stop_s", refused_at - stopped_at, "s")
            figures("engine_sigstop.recovery_after_sigcont_s", recovered_at - continued_at, "s", "SIGCONT to first 200")
            await async_wait_until(lambda: gateway.leases() == 0, within=5, message="a slot leaked")
            await async_wait_until(
                lambda: in_flight_settled(gateway.url, baseline), within=5, message="in-flight leaked"
            )


async def first_refusal(client: httpx.AsyncClient, url: str, headers: dict[str, str], deadline: float) -> float:
    """When a new request to the frozen engine was first answered (it must be a 503) before `deadline`."""
    body = chat_body(stream=False, max_tokens=1, token_delay=0)
    while (left := deadline - time.monotonic()) > 0:
        try:
            response = await client.post(url, json=body, headers=headers, timeout=min(left, 5.0))
        except httpx.TimeoutException:
            continue  # still held by the frozen engine: ask again until the deadline
        assert response.status_code == 503, response.text
        assert response.headers.get("retry-after", "").isdigit()
        return time.monotonic()
    raise AssertionError("requests to a frozen engine were neither answered nor refused")


CUT_STREAMS = 48
CUT_AFTER = 4


async def test_streams_cut_by_the_engine_deliver_every_chunk_it_sent_then_one_error(
    fault_engine: FakeEngineControl, redis_url: str, figures: Figures
) -> None:
    # Before: at 0 ms between tokens 2 of 40 streams got only the error event: aiohttp raised the connection's
    # error before handing over the chunks it had buffered.
    body = {**chat_body(max_tokens=50, token_delay=0.0), "fake_die_after": CUT_AFTER}
    with gateway_on(fault_engine, redis_url) as gateway:
        url = f"{gateway.url}/v1/chat/completions"
        async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=CUT_STREAMS)) as client:
            outcomes = await asyncio.gather(
                *(read_stream(client, url, gateway.headers, body) for _ in range(CUT_STREAMS))
            )
    short = [outcome.tokens for outcome in outcomes if outcome.tokens != CUT_AFTER + 1]
    figures("engine_cut.streams_missing_chunks", len(short), "streams", f"of {CUT_STREAMS}, cut after {CUT_AFTER}")
    for index, outcome in enumerate(outcomes):
        assert_ended_with_one_error(outcome, f"stream {index}")
    # The role chunk and every token the engine sent, then the error event.
    assert not short, f"{len(short)} of {CUT_STREAMS} streams lost chunks the engine had sent: {short}"
