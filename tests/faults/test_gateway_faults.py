"""Gateway faults: SIGTERM with streams in flight.

Streams that can finish within NEMOTRON_SHUTDOWN_GRACE finish; the others end at the grace's end with
one SSE error event, never a silent cut; new connections are refused from the SIGTERM on.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import time

import httpx
import pytest

from tests.faults.conftest import (
    Figures,
    StreamOutcome,
    assert_ended_with_one_error,
    chat_body,
    gateway_on,
    lease_count,
    read_stream,
)
from tests.procs import FakeEngineControl, async_wait_until

pytestmark = [pytest.mark.faults, pytest.mark.timeout(120)]

GRACE = 4.0


def refuses_connections(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
    except ConnectionRefusedError:
        return True
    return False


async def test_sigterm_lets_short_streams_finish_and_ends_long_ones_with_an_error(
    fault_engine: FakeEngineControl, redis_url: str, figures: Figures
) -> None:
    fault_engine.reset()
    with gateway_on(fault_engine, redis_url, NEMOTRON_SHUTDOWN_GRACE=str(GRACE)) as gateway:
        url, port = f"{gateway.url}/v1/chat/completions", int(gateway.url.rsplit(":", 1)[1])
        # 40 tokens 50 ms apart: about 2 s, well inside the grace; 2000 tokens: far past it.
        bodies = [chat_body(max_tokens=40, token_delay=0.05)] * 4 + [chat_body(max_tokens=2000)] * 4
        async with httpx.AsyncClient(timeout=httpx.Timeout(GRACE + 20, connect=5.0)) as client:
            started = [asyncio.Event() for _ in bodies]
            streams: list[asyncio.Task[StreamOutcome]] = [
                asyncio.create_task(read_stream(client, url, gateway.headers, body, event))
                for body, event in zip(bodies, started, strict=True)
            ]
            await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 30)
            term_at = time.monotonic()
            gateway.proc.send_signal(signal.SIGTERM)
            await async_wait_until(lambda: refuses_connections(port), within=5, message="still accepting")
            figures("gateway_sigterm.refusing_new_connections_after_s", time.monotonic() - term_at, "s")
            outcomes = await asyncio.wait_for(asyncio.gather(*streams), GRACE + 20)
        for index, outcome in enumerate(outcomes[:4]):
            assert outcome.transport_error is None and outcome.done, f"short stream {index} cut: {outcome.data[-2:]}"
            assert not outcome.errors
        # Held through the grace, not cut at the signal: each long stream outlived every short one (which needed
        # ~2 s more of the engine's tokens after the signal), and its error is the one the server's cancel at the
        # grace's end writes.
        short_ended = max(outcome.ended_at for outcome in outcomes[:4])
        for index, outcome in enumerate(outcomes[4:]):
            assert_ended_with_one_error(outcome, f"long stream {index}")
            assert outcome.ended_at > short_ended, f"long stream {index} ended before the short ones had finished"
            assert "shutting down" in outcome.errors[0]["message"], outcome.errors
        figures("gateway_sigterm.long_streams_ended_after_s", max(o.ended_at for o in outcomes) - term_at, "s")
        await async_wait_until(lambda: not gateway.proc.running, within=60, message="gateway did not exit")
        # uvicorn re-raises the signal once it has shut down: death by SIGTERM is its clean exit.
        assert gateway.proc.stop() in (0, -signal.SIGTERM)
        await async_wait_until(
            lambda: lease_count(redis_url, gateway.key_name) == 0, within=5, message="a stopped gateway left slots"
        )
