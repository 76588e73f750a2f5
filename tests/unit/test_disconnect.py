"""The client-disconnect watcher: the work's result or error when the client stays, the work cancelled when it
leaves, told by `receive` or by the server's watch (raw ASGI, no sockets)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from gateway.relay.disconnect import ClientDisconnectedError, run_until_disconnect
from gateway.types import Message

pytestmark = pytest.mark.timeout(5)


class Client:
    """The ASGI receive of a client that stays until `disconnect` is set."""

    def __init__(self) -> None:
        self.disconnect = asyncio.Event()

    async def receive(self) -> Message:
        await self.disconnect.wait()
        return {"type": "http.disconnect"}


class Connection:
    """A `DisconnectWatch` as the gateway's server offers one: `leave()` is the client's connection lost."""

    def __init__(self, gone: bool = False) -> None:
        self.gone = gone
        self.callback: Callable[[], None] | None = None

    def arm(self, callback: Callable[[], None]) -> bool:
        if self.gone:
            return False
        self.callback = callback
        return True

    def disarm(self) -> None:
        self.callback = None

    def leave(self) -> None:
        self.gone = True
        callback, self.callback = self.callback, None
        if callback is not None:
            callback()


async def _never_received() -> Message:
    raise AssertionError("with a watch, receive is not read")


async def test_run_until_disconnect_returns_the_work_result() -> None:
    client = Client()

    async def work() -> str:
        await asyncio.sleep(0)
        return "answer"

    assert await run_until_disconnect(client.receive, work()) == "answer"


async def test_run_until_disconnect_propagates_the_work_error() -> None:
    client = Client()

    async def work() -> None:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        await run_until_disconnect(client.receive, work())


@pytest.mark.parametrize("told_by", ["receive", "watch"])
async def test_run_until_disconnect_cancels_work_when_the_client_leaves(told_by: str) -> None:
    # Told by a disconnect read from `receive`, or by the server's watch (the work then runs in the caller's task).
    client, connection = Client(), Connection()
    cancelled = asyncio.Event()

    async def work() -> str:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "too late"

    by_watch = told_by == "watch"
    leave = connection.leave if by_watch else client.disconnect.set
    asyncio.get_running_loop().call_later(0.01, leave)
    with pytest.raises(ClientDisconnectedError):
        await run_until_disconnect(
            _never_received if by_watch else client.receive, work(), connection if by_watch else None
        )
    assert cancelled.is_set()
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0  # the caller goes on answering 499
    await asyncio.sleep(0)  # and is not cancelled at its next await


async def test_run_until_disconnect_ignores_other_messages_until_disconnect() -> None:
    queue: asyncio.Queue[Message] = asyncio.Queue()
    queue.put_nowait({"type": "http.request", "body": b"", "more_body": False})
    done = asyncio.Event()

    async def work() -> int:
        await done.wait()
        return 7

    task = asyncio.create_task(run_until_disconnect(queue.get, work()))
    await asyncio.sleep(0.01)
    assert not task.done()
    done.set()
    assert await task == 7


async def test_run_until_disconnect_propagates_outer_cancellation_and_cancels_work() -> None:
    client = Client()
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def work() -> None:
        started.set()
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    outer = asyncio.create_task(run_until_disconnect(client.receive, work()))
    await started.wait()
    outer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await outer
    await asyncio.wait_for(cancelled.wait(), 1.0)


async def test_with_a_watch_the_work_runs_in_the_callers_task_and_the_watch_is_disarmed() -> None:
    connection = Connection()
    caller = asyncio.current_task()

    async def work() -> bool:
        await asyncio.sleep(0)
        return asyncio.current_task() is caller

    assert await run_until_disconnect(_never_received, work(), connection) is True
    assert connection.callback is None


async def test_with_a_watch_a_client_already_gone_starts_no_work() -> None:
    started = False

    async def work() -> None:
        nonlocal started
        started = True

    with pytest.raises(ClientDisconnectedError):
        await run_until_disconnect(_never_received, work(), Connection(gone=True))
    assert not started


async def test_with_a_watch_an_outer_cancellation_stays_a_cancellation() -> None:
    connection = Connection()
    started = asyncio.Event()

    async def work() -> None:
        started.set()
        await asyncio.sleep(10)

    outer = asyncio.create_task(run_until_disconnect(_never_received, work(), connection))
    await started.wait()
    outer.cancel()
    connection.leave()  # the client leaves too: the server's cancel still wins
    with pytest.raises(asyncio.CancelledError):
        await outer
    assert connection.callback is None
