"""What the supervisor does while its engine idles: a liveness check every `health_interval`, and only now and
then the sample of the engine group's /dev/shm files (all of /proc and the engine's memory maps: a few ms each)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gateway.engine.supervisor_state import EngineState
from gateway.settings import Settings
from gateway.supervisor.cli import _build_replicas
from gateway.supervisor.process import GuardedProcess
from tests.e2e.supervised import engine_env
from tests.procs import async_wait_until, free_port

pytestmark = pytest.mark.timeout(60)


async def test_a_ready_engine_is_checked_often_and_its_shared_memory_sampled_rarely(
    state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in engine_env(state_dir, free_port()).items():  # a liveness check every 0.3 s
        monkeypatch.setenv(name, value)
    samples = 0
    sample = GuardedProcess.sample_shared_memory

    def counted(process: GuardedProcess) -> None:
        nonlocal samples
        samples += 1
        sample(process)

    monkeypatch.setattr(GuardedProcess, "sample_shared_memory", counted)
    (supervisor,) = _build_replicas(Settings()).supervisors
    running = asyncio.create_task(supervisor.run())
    try:
        await async_wait_until(lambda: supervisor.status.state == EngineState.READY, within=30)
        sampled_when_ready = samples
        await asyncio.sleep(3)  # ten checks
        assert supervisor.status.state == EngineState.READY
        # Before, every check sampled too (ten here); now once every 30 s.
        assert samples - sampled_when_ready <= 1
    finally:
        supervisor.handle_exit()
        assert await asyncio.wait_for(running, 20) == 0
