"""The reaper's own CPU while its command idles: it waits on the command, its stdin and /dev/shm, it does not poll."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.supervised import fake_shm_files
from tests.procs import REPO_ROOT, fake_engine_argv, free_port, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

IDLE_SECONDS = 30.0
# CPU-seconds the reaper may use in IDLE_SECONDS: the 0.5 s /proc sampler it replaced used 0.26 here (around the
# fake engine; 2.3-4.5 around vLLM under `up` on a 16-core host). Its voluntary context switches: ~350 (10 wake-ups
# a second) against ~10 (the slow safety scan, and /dev/shm files created on the host).
IDLE_CPU_BOUND = 0.1
IDLE_WAKEUP_BOUND = 60


def cpu_seconds(pid: int) -> float:
    """utime + stime of `pid`, from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wakeups(pid: int) -> int:
    """Voluntary context switches of all of `pid`'s threads: how often it went to sleep and woke up."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            if line.startswith("voluntary_ctxt_switches:"):
                total += int(line.split()[1])
    return total


def test_an_idle_reaper_uses_almost_no_cpu_and_still_cleans_up() -> None:
    before = fake_shm_files()
    reaper = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gateway.supervisor.reaper",
            "--grace",
            "1",
            "--",
            *fake_engine_argv(free_port(), spawn_child=True),
        ],
        stdin=subprocess.PIPE,
        cwd=REPO_ROOT,
        start_new_session=True,  # the reaper leads its own group, as GuardedProcess starts it
    )
    try:
        # The engine's helper holds a /dev/shm file (and a semaphore) like EngineCore; then everything idles.
        wait_until(lambda: fake_shm_files() - before, timeout=30, message="the helper's /dev/shm file")
        time.sleep(2.0)
        start, woken = cpu_seconds(reaper.pid), wakeups(reaper.pid)
        time.sleep(IDLE_SECONDS)
        used, woken = cpu_seconds(reaper.pid) - start, wakeups(reaper.pid) - woken
        assert used < IDLE_CPU_BOUND, f"the reaper used {used:.2f} CPU-s in {IDLE_SECONDS:.0f} s of idling"
        assert woken < IDLE_WAKEUP_BOUND, f"the reaper woke up {woken} times in {IDLE_SECONDS:.0f} s of idling"
    finally:
        assert reaper.stdin is not None
        reaper.stdin.close()  # the supervisor's death, as the reaper sees it
        reaper.wait(timeout=30)
    # Still its job: the group is gone and the /dev/shm file its helper held with it.
    assert not fake_shm_files() - before
