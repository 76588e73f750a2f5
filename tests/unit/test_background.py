"""BackgroundTask: runs again after failures with backoff, stops in bounded time whatever its body does."""

from __future__ import annotations

import asyncio
import logging

import pytest

from gateway.background import BackgroundTask, Backoff
from tests.procs import async_wait_until

pytestmark = pytest.mark.timeout(20)

FAST = Backoff(initial=0.001, maximum=0.01)


class Outage(ConnectionError):
    """Stands for a Redis outage."""


def test_backoff_grows_to_its_maximum_with_jitter() -> None:
    backoff = Backoff(initial=0.1, maximum=2.0)
    for failures, ceiling in [(1, 0.1), (2, 0.2), (3, 0.4), (6, 2.0), (50, 2.0)]:
        delays = [backoff.delay(failures) for _ in range(200)]
        assert all(ceiling / 2 <= delay <= ceiling for delay in delays), (failures, min(delays), max(delays))
        assert len(set(delays)) > 1  # jittered


async def test_a_failing_body_runs_again_and_an_outage_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    runs = 0

    async def body() -> None:
        nonlocal runs
        runs += 1
        if runs < 5:
            raise Outage("redis is down")
        await asyncio.Event().wait()  # then runs well until stopped

    task = BackgroundTask("listener", body, expected=(Outage,), backoff=FAST)
    with caplog.at_level(logging.DEBUG, logger="gateway.background"):
        task.start()
        await async_wait_until(lambda: runs == 5 and task.running, within=10)
        assert await task.stop()
    assert not task.running
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [r.getMessage() for r in warnings] == ["background task listener failed (Outage); retrying with backoff"]


async def test_an_unexpected_error_is_logged_with_its_traceback_and_retried(caplog: pytest.LogCaptureFixture) -> None:
    runs = 0

    async def body() -> None:
        nonlocal runs
        runs += 1
        if runs == 1:
            raise KeyError("bug")

    task = BackgroundTask("renewer", body, backoff=FAST)
    task.start()
    await async_wait_until(lambda: runs == 2 and not task.running, within=10)
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is not None
    assert await task.stop()


async def test_stop_ends_a_body_that_turns_its_cancellation_into_an_error() -> None:
    # redis-py may answer the cancellation of a blocked read with a ConnectionError: the loop must not
    # take that for an outage and run the body again.
    runs = 0
    blocked = asyncio.Event()

    async def body() -> None:
        nonlocal runs
        runs += 1
        try:
            blocked.set()
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            raise Outage("connection lost while reading") from None

    task = BackgroundTask("listener", body, expected=(Outage,), backoff=FAST, stop_timeout=5)
    task.start()
    await blocked.wait()
    assert await task.stop()
    assert runs == 1
    assert not task.running


async def test_stop_gives_up_after_its_timeout_on_a_body_that_will_not_end(caplog: pytest.LogCaptureFixture) -> None:
    release = asyncio.Event()
    blocked = asyncio.Event()

    async def stubborn() -> None:
        blocked.set()
        while not release.is_set():
            try:
                await release.wait()
            except asyncio.CancelledError:
                continue  # swallows every cancellation

    task = BackgroundTask("stubborn", stubborn, stop_timeout=0.2)
    task.start()
    await blocked.wait()
    assert not await task.stop()
    assert "background task stubborn did not stop within 0.2 s" in caplog.text
    release.set()  # let it end, so the loop closes cleanly
    await async_wait_until(lambda: all(t.done() for t in asyncio.all_tasks() if t.get_name() == "stubborn"))


async def test_every_ticks_on_its_interval_and_survives_a_failing_tick() -> None:
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        ticks += 1
        if ticks == 2:
            raise Outage("one bad tick")

    task = BackgroundTask.every("ticker", 0.001, tick, expected=(Outage,), backoff=FAST)
    task.start()
    await async_wait_until(lambda: ticks >= 5, within=10)
    assert task.running
    assert await task.stop()


async def test_start_twice_keeps_one_task_and_stop_without_start_is_a_no_op() -> None:
    task = BackgroundTask("idle", asyncio.Event().wait)
    assert await task.stop()
    task.start()
    first = [t for t in asyncio.all_tasks() if t.get_name() == "idle"]
    task.start()
    assert [t for t in asyncio.all_tasks() if t.get_name() == "idle"] == first
    assert await task.stop()
