"""The supervisor on the real CPU vLLM: SIGSTOP of the EngineCore process alone (vLLM's /health keeps answering
200) and the engine is restarted within the stated bound, `engine status` says why, and the stopped group's
/dev/shm files (vLLM's `sem.mp-*` semaphores included) are gone. One engine start, plus its restart.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from gateway.supervisor.process import group_members, shared_memory_inodes
from tests.engine.conftest import CACHE_ROOT
from tests.engine.stacks import engine_core_pid
from tests.procs import REPO_ROOT, ServerProcess, free_port, wait_until

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

STATE_DIR = CACHE_ROOT / "engine-tests-supervisor"
STALL, INTERVAL = 10.0, 1.0


def status() -> dict[str, object]:
    try:
        return dict(json.loads((STATE_DIR / "engine.json").read_text()))
    except (OSError, ValueError):
        return {}


def shm_inodes_now() -> set[int]:
    inodes = set()
    for entry in os.scandir("/dev/shm"):
        with contextlib.suppress(OSError):
            inodes.add(entry.inode())
    return inodes


@pytest.fixture(scope="module")
def supervisor(demo_model_dir: str) -> Iterator[ServerProcess]:
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = {
        "NEMOTRON_ENGINE__MODEL": demo_model_dir,
        # vllm serve runs its engine core as a process of its own (the cpu-dev profile's
        # VLLM_ENABLE_V1_MULTIPROCESSING=0 only concerns vLLM's offline LLM class).
        "NEMOTRON_ENGINE__PROFILE": "cpu-dev",
        "NEMOTRON_ENGINE__PORT": str(port),
        "NEMOTRON_ENGINE__STATE_DIR": str(STATE_DIR),
        "NEMOTRON_ENGINE__METRICS_PORT": "0",
        "NEMOTRON_ENGINE__HEALTH_INTERVAL": str(INTERVAL),
        "NEMOTRON_ENGINE__STALL_TIMEOUT": str(STALL),
        "NEMOTRON_ENGINE__BACKOFF_INITIAL": "0.5",
        "NEMOTRON_ENGINE__RUN_DOCTOR": "false",  # asked in test_stack.py; here one import of vLLM fewer a start
        "VLLM_CACHE_ROOT": str(CACHE_ROOT / "vllm"),
        "HF_HUB_OFFLINE": "1",
    }
    (STATE_DIR / "engine.json").unlink(missing_ok=True)
    proc = ServerProcess(
        [sys.executable, "-m", "gateway", "engine"],
        env=env,
        ready_check=lambda: status().get("state") == "ready",
        start_timeout=420,
        stop_timeout=60,
        port=port,
    )
    with proc.start():
        yield proc


def test_stopped_engine_core_is_restarted_within_the_bound(supervisor: ServerProcess) -> None:
    first = status()
    vllm, group = int(str(first["engine_pid"])), int(str(first["group_pid"]))
    core = wait_until(lambda: engine_core_pid(vllm), timeout=60, message="no EngineCore process below vLLM")
    engine = str(first["engine_url"])
    held = shared_memory_inodes(group_members(group))
    os.kill(core, signal.SIGSTOP)
    try:
        assert httpx.get(f"{engine}/health", timeout=30).status_code == 200, "vLLM's /health hides a stopped core"
        # The bound is STALL + INTERVAL (11 s); the deadline is generous for a loaded 2-core machine.
        wait_until(lambda: status().get("restarts") == 1, timeout=STALL + INTERVAL + 60, interval=0.5)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(core, signal.SIGCONT)
    history = status()["history"]
    assert isinstance(history, list) and history[-1]["cause"] == "not generating", history
    wait_until(lambda: not group_members(group), timeout=30, message="the stopped engine's group lingered")
    assert not held & shm_inodes_now(), "a /dev/shm file of the killed engine survived"
    text = subprocess.run(
        [sys.executable, "-m", "gateway", "engine", "status"],
        env={**os.environ, "NEMOTRON_ENGINE__STATE_DIR": str(STATE_DIR)},
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO_ROOT,
        check=False,
    ).stdout
    assert "not generating" in text, text
    wait_until(lambda: status().get("state") == "ready", timeout=420, interval=1.0)
    assert status()["engine_pid"] != vllm
    assert httpx.get(f"{engine}/health", timeout=30).status_code == 200
    # The checks (/health while starting, /metrics every second) write no access lines.
    log = supervisor.log_text()
    assert "--disable-access-log-for-endpoints /health,/metrics" in log
    assert '"GET /health HTTP' not in log and '"GET /metrics HTTP' not in log
