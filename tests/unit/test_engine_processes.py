"""An engine of several processes on several GPUs: each process watched, and every GPU's memory seen freed."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from dataclasses import replace

import pytest

from gateway.engine.nvml import GpuProcess, GpuReadings
from gateway.supervisor.process import GuardedProcess, MemberWatch
from gateway.supervisor.supervisor import held_gpu_memory, wait_gpu_memory_released
from tests.unit.doctor.samples import GiB, h200

pytestmark = pytest.mark.timeout(20)

ENGINE = (4242, 4243)  # a tensor-parallel engine's two workers, one per GPU
HELD = GpuReadings(
    "580.159.04",
    (13, 0),
    (
        replace(h200(0), processes=(GpuProcess(4242, 70 * GiB),)),
        replace(h200(1), processes=(GpuProcess(4243, None), GpuProcess(999, 1 * GiB))),
    ),
)
FREED = replace(HELD, devices=(h200(0), replace(h200(1), processes=(GpuProcess(999, 1 * GiB),))))


def test_the_gpu_memory_an_ended_engine_still_holds_is_named_per_gpu() -> None:
    assert held_gpu_memory(HELD, ENGINE) == ["GPU 0: pid 4242 (70.0 GiB)", "GPU 1: pid 4243 (size unknown)"]
    assert held_gpu_memory(FREED, ENGINE) == []  # pid 999 is not the engine's


def test_the_supervisor_waits_for_every_gpus_memory_and_says_what_stays(caplog: pytest.LogCaptureFixture) -> None:
    answers = iter([HELD, HELD, FREED])
    assert asyncio.run(wait_gpu_memory_released(ENGINE, lambda: next(answers), within=5)) == []
    stuck = asyncio.run(wait_gpu_memory_released(ENGINE, lambda: HELD, within=0.3))
    assert stuck == ["GPU 0: pid 4242 (70.0 GiB)", "GPU 1: pid 4243 (size unknown)"]
    assert "GPU memory still held" in caplog.text
    assert asyncio.run(wait_gpu_memory_released((), lambda: HELD)) == []  # no engine process: nothing to wait for


def test_a_watched_process_that_is_not_our_child_reports_its_exit() -> None:
    # The watcher's processes are vLLM's children, not the supervisor's: a grandchild stands in for one.
    script = (
        "import subprocess, sys; print(subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']).pid)"
    )
    with subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) as parent:
        assert parent.stdout is not None
        grandchild = int(parent.stdout.readline())
        parent.wait()

    async def kill_one() -> int:
        watch = MemberWatch([grandchild, 2**22 + 7])  # the second is no process: left out
        assert watch.pids == [grandchild]
        ended = asyncio.ensure_future(watch.first_exit())
        await asyncio.sleep(0.2)
        assert not ended.done()
        os.kill(grandchild, signal.SIGKILL)
        try:
            return await asyncio.wait_for(ended, 5)
        finally:
            watch.close()

    assert asyncio.run(kill_one()) == grandchild


def test_a_process_that_left_the_group_holding_the_output_does_not_hang_the_end(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # vLLM's command exits, leaving a helper in a session of its own (out of the group its reaper tears down)
    # that still holds the output pipe: the engine's end is reported, not held up until the helper ends. The helper
    # outlives the test's own timeout, so an end that waited for it could not come at all.
    script = "import subprocess; print(subprocess.Popen(['sleep', '600'], start_new_session=True).pid, flush=True)"
    process = GuardedProcess([sys.executable, "-c", script], env=dict(os.environ), grace=1.0)

    async def run() -> int:
        await process.start()
        return await process.wait()

    try:
        code = asyncio.run(run())
    finally:
        helpers = [int(line) for line in process.tail if line.isdigit()]
        for pid in helpers:
            os.kill(pid, signal.SIGKILL)
    assert helpers, list(process.tail)
    assert code == 0
    assert "engine output still open" in caplog.text
