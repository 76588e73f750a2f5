"""An engine made of several processes (vLLM's API server, EngineCore, a worker per GPU), as the test engine's
helpers stand in for them: the supervisor watches each one, and one of them killed restarts the whole engine,
leaving no process and no /dev/shm file of the old one behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.supervised import fake_shm_files, group_alive, start_supervisor, status
from tests.procs import REPO_ROOT, free_port, wait_until

pytestmark = pytest.mark.timeout(90)

THREE_PROCESSES = '["--spawn-child","--spawn-child"]'  # vLLM's stand-in and two SIGTERM-deaf helpers


def _helpers(state_dir: Path) -> list[int]:
    now = status(state_dir)
    return [int(pid) for pid in list(now.get("processes") or []) if pid != now.get("engine_pid")]


def test_kill_9_of_one_engine_process_restarts_the_whole_engine(state_dir: Path) -> None:
    port = free_port()
    before = fake_shm_files()
    supervisor = start_supervisor(state_dir, port, NEMOTRON_ENGINE__EXTRA_ARGS=THREE_PROCESSES)
    try:
        wait_until(lambda: len(_helpers(state_dir)) == 2, timeout=10, message="the helpers are not watched")
        group = int(str(status(state_dir)["group_pid"]))
        old = [int(str(status(state_dir)["engine_pid"])), *_helpers(state_dir)]
        held = {f"fake-engine-{pid}" for pid in old[1:]}
        assert held <= fake_shm_files()
        listing = subprocess.run(
            [sys.executable, "-m", "gateway", "engine", "status"],
            env={**os.environ, "NEMOTRON_ENGINE__STATE_DIR": str(state_dir)},
            capture_output=True,
            text=True,
            cwd=REPO_ROOT,
            check=False,
        ).stdout
        assert all(str(pid) in listing for pid in old), listing

        os.kill(old[2], signal.SIGKILL)  # one worker dies; vLLM's stand-in and the other stay up
        wait_until(lambda: status(state_dir).get("restarts") == 1, timeout=15, message=supervisor.log_text()[-3000:])
        last = status(state_dir)["history"][-1]  # type: ignore[index]
        assert last["cause"] == "crash" and f"engine process {old[2]} " in last["reason"], last
        wait_until(lambda: not group_alive(group), timeout=10, message="the old engine group survived")
        assert held & fake_shm_files() == set(), "the old helpers' /dev/shm files must be removed"
        wait_until(lambda: status(state_dir).get("state") == "ready", timeout=20)
        wait_until(lambda: len(_helpers(state_dir)) == 2, timeout=10)
        assert set(status(state_dir)["processes"]).isdisjoint(old)  # type: ignore[arg-type]
    finally:
        code = supervisor.stop()
    assert code == 0
    assert fake_shm_files() - before == set()
    assert status(state_dir)["processes"] == []
