"""vLLM's verdict on the engine's configuration, asked beside the engine's start: the supervisor (in this process)
over the fake engine, with a slow preflight standing in for the verdict's import of vLLM."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import pytest

from gateway.engine.supervisor_state import EngineState, EngineStatus
from gateway.settings import EngineSettings
from gateway.supervisor.process import group_members
from gateway.supervisor.supervisor import EngineSupervisor
from tests.e2e.supervised import status
from tests.procs import REPO_ROOT, async_wait_until, free_port

pytestmark = pytest.mark.timeout(60)

REFUSAL = "preflight checks failed (see `nemotron-gateway doctor`):\ncontext length  fail  4096 > 2048"


def _supervisor(state_dir: Path, startup_delay: float, preflight: object) -> tuple[EngineSupervisor, list[float]]:
    """A supervisor of the fake engine (ready after `startup_delay` s), and the times its status said READY."""
    port = free_port()
    settings = EngineSettings(
        state_dir=state_dir, port=port, health_interval=0.3, probe_timeout=0.5, stop_grace=2.0, backoff_initial=0.2
    )
    argv = [sys.executable, "-m", "tests.fakes.fake_engine", "--port", str(port), "--startup-delay", str(startup_delay)]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    status_ = EngineStatus(profile="cpu-dev", model="/models/fake", engine_url=f"http://127.0.0.1:{port}")
    supervisor = EngineSupervisor(settings, argv, env, status=status_, preflight=preflight)  # type: ignore[arg-type]
    ready_at: list[float] = []
    set_state = supervisor._set_state

    def recording(state: EngineState, reason: str | None = None) -> None:
        if state is EngineState.READY:
            ready_at.append(time.monotonic())
        set_state(state, reason)

    supervisor._set_state = recording  # type: ignore[method-assign]
    return supervisor, ready_at


async def test_a_refusal_during_the_start_stops_the_engine_and_ends_in_failed(tmp_path: Path) -> None:
    def refuse() -> str:
        time.sleep(0.5)
        return REFUSAL

    # The engine's start-up outlasts the test: a run that went on for it could not end within the wait.
    supervisor, ready_at = _supervisor(tmp_path, startup_delay=3600.0, preflight=refuse)
    code = await asyncio.wait_for(supervisor.run(), timeout=30)
    assert code == 2
    assert ready_at == []
    assert supervisor.process is not None and group_members(supervisor.process.pid) == []
    final = status(tmp_path)
    assert final["state"] == "failed" and "context length" in str(final["reason"])


@pytest.mark.parametrize("refused", [None, REFUSAL])
async def test_an_engine_up_before_the_verdict_is_ready_only_once_it_passed(
    tmp_path: Path, refused: str | None
) -> None:
    answered_at: list[float] = []

    def slow_verdict() -> str | None:
        time.sleep(4.0)  # the fake engine is up within a second
        answered_at.append(time.monotonic())
        return refused

    supervisor, ready_at = _supervisor(tmp_path, startup_delay=0.0, preflight=slow_verdict)
    running = asyncio.ensure_future(supervisor.run())
    try:
        await async_wait_until(lambda: answered_at, 20, 0.1, "the preflight never answered")
        if refused is None:
            await async_wait_until(lambda: ready_at, 20, 0.1, "never ready after the verdict")
            assert ready_at and ready_at[0] >= answered_at[0]
            assert status(tmp_path)["state"] == "ready"
            supervisor.handle_exit()
            assert await asyncio.wait_for(running, timeout=15) == 0
        else:
            assert await asyncio.wait_for(running, timeout=15) == 2
            assert ready_at == [], "an engine the preflight refused was reported ready"
            assert status(tmp_path)["state"] == "failed"
    finally:
        if not running.done():
            supervisor.handle_exit()
            supervisor.handle_exit()
            await asyncio.wait_for(running, timeout=15)
