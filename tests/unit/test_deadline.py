"""`gateway.deadline`: the request path's deadlines behave as `asyncio.timeout` does, on one shared timer."""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref

import pytest
import uvloop

from gateway.deadline import deadline
from tests.clock import virtual_time

pytestmark = pytest.mark.timeout(30)


@virtual_time
async def test_a_late_block_raises_timeout_error_at_its_deadline() -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(TimeoutError):
        async with deadline(0.1) as block:
            await asyncio.sleep(5)
    assert loop.time() - started == pytest.approx(0.1)  # the loop's virtual clock: exactly when it was due
    assert block.expired()


async def test_a_block_that_finishes_in_time_is_not_cancelled_later() -> None:
    async with deadline(0.1) as block:
        await asyncio.sleep(0.01)
    assert not block.expired()
    await asyncio.sleep(0.2)  # past the deadline: nothing may cancel this task now
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]  # inside a task


async def test_a_deadline_already_past_cancels_at_the_next_turn() -> None:
    with pytest.raises(TimeoutError):
        async with deadline(-1.0):
            await asyncio.sleep(1)


async def test_a_cancel_from_elsewhere_stays_a_cancel() -> None:
    entered = asyncio.Event()

    async def work() -> None:
        async with deadline(10):
            entered.set()
            await asyncio.sleep(10)

    task = asyncio.ensure_future(work())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_cancel_from_elsewhere_at_the_deadline_is_not_turned_into_a_timeout() -> None:
    async def work() -> None:
        async with deadline(0.05):
            try:
                await asyncio.sleep(10)
            finally:
                # The deadline's cancel arrived; an outside one is added before the block is left.
                current = asyncio.current_task()
                assert current is not None
                current.cancel()
                await asyncio.sleep(0)

    task = asyncio.ensure_future(work())
    with pytest.raises(asyncio.CancelledError):
        await task


@virtual_time
async def test_an_earlier_deadline_inside_a_later_one_fires_first() -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    async with deadline(10) as outer:
        with pytest.raises(TimeoutError):
            async with deadline(0.05):
                await asyncio.sleep(10)
        inner_done = loop.time() - started
        await asyncio.sleep(0.01)  # the outer block goes on, uncancelled
    assert inner_done == pytest.approx(0.05)
    assert not outer.expired()


@virtual_time
async def test_many_blocks_each_end_at_their_own_deadline() -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    ended: dict[int, float | None] = {}

    async def block(index: int, delay: float, works_for: float) -> None:
        try:
            async with deadline(delay):
                await asyncio.sleep(works_for)
            ended[index] = None  # finished in time
        except TimeoutError:
            ended[index] = loop.time() - started

    # Deadlines entered latest-first and earliest-first, some blocks finishing before theirs.
    plan = [(i, 0.3 - i * 0.02, 10.0 if i % 2 else 0.01) for i in range(10)]
    await asyncio.gather(*(block(i, delay, works) for i, delay, works in plan))
    for index, delay, works_for in plan:
        if works_for < delay:
            assert ended[index] is None, index
        else:
            fired = ended[index]
            assert fired == pytest.approx(delay), (index, fired)


async def test_asyncio_timeout_outside_a_deadline_still_wins_its_own_race() -> None:
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            async with deadline(10) as inner:
                await asyncio.sleep(10)
    assert not inner.expired()


def test_deadlines_of_two_loops_in_two_threads_keep_apart() -> None:
    # Real loops on the real clock, at once. Each block must end at its own deadline, on its own loop: never
    # before it (read on that loop's clock, which the deadline is set on), and the asyncio block before its work
    # ends at 0.29 s, which only its own timer ensures (due first, it runs first however late the loop turns).
    # Had it waited for uvloop's timer (0.3 s), the work would end first and no TimeoutError would come.
    results: dict[str, float] = {}

    async def timed(name: str, delay: float, works_for: float) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(TimeoutError):
            async with deadline(delay):
                await asyncio.sleep(works_for)
        results[name] = loop.time() - started

    other = threading.Thread(target=lambda: uvloop.run(timed("uvloop", 0.3, 10)))
    other.start()
    asyncio.run(timed("asyncio", 0.1, 0.29))
    other.join(30)
    assert results["asyncio"] >= 0.1 - 0.002
    assert results["uvloop"] >= 0.3 - 0.002  # libuv's clock counts milliseconds


async def test_outside_a_task_it_says_so() -> None:
    loop = asyncio.get_running_loop()
    said: asyncio.Future[str] = loop.create_future()

    def in_a_callback() -> None:  # the loop runs it, but no task: `current_task()` is None here
        coroutine = deadline(1).__aenter__()
        try:
            coroutine.send(None)
        except RuntimeError as exc:
            said.set_result(str(exc))

    loop.call_soon(in_a_callback)
    assert "inside a task" in await said


def test_a_closed_loop_is_not_kept_alive_by_its_shared_timer() -> None:
    loop = asyncio.new_event_loop()

    async def work() -> None:
        async with deadline(10):
            await asyncio.sleep(0)
        with pytest.raises(TimeoutError):
            async with deadline(0.01):  # earlier than the first: a second timer, the first left stale
                await asyncio.sleep(1)

    loop.run_until_complete(work())
    loop.close()
    closed = weakref.ref(loop)
    del loop
    gc.collect()
    assert closed() is None
