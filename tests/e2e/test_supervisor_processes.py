"""An engine made of several processes (vLLM's API server, EngineCore, a worker per GPU), as the test engine's
helpers stand in for them: the supervisor watches each one, and one of them killed restarts the whole engine,
leaving no process and no /dev/shm file of the old one behind."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import pytest

from gateway.supervisor.reaper import MIN_SCAN_GAP
from tests.e2e.supervised import engine_status_text, fake_shm_files, group_alive, start_supervisor, status
from tests.procs import ServerProcess, free_port, wait_until

pytestmark = pytest.mark.timeout(90)

THREE_PROCESSES = '["--spawn-child","--spawn-child"]'  # vLLM's stand-in and two SIGTERM-deaf helpers


def _processes(state_dir: Path) -> list[int]:
    listed = status(state_dir).get("processes")
    return [int(pid) for pid in listed] if isinstance(listed, list) else []


def _helpers(state_dir: Path) -> list[int]:
    return [pid for pid in _processes(state_dir) if pid != status(state_dir).get("engine_pid")]


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
        listing = engine_status_text(state_dir)
        assert all(str(pid) in listing for pid in old), listing

        # The reaper notes a new /dev/shm file within MIN_SCAN_GAP of its creation; a helper killed sooner would
        # take the only record of its file with it (vLLM's workers live far longer than that).
        time.sleep(MIN_SCAN_GAP + 0.5)
        os.kill(old[2], signal.SIGKILL)  # one worker dies; vLLM's stand-in and the other stay up
        wait_until(lambda: status(state_dir).get("restarts") == 1, timeout=15, message=supervisor.log_text()[-3000:])
        last = status(state_dir)["history"][-1]  # type: ignore[index]
        assert last["cause"] == "crash" and f"engine process {old[2]} " in last["reason"], last
        wait_until(lambda: not group_alive(group), timeout=10, message="the old engine group survived")
        assert held & fake_shm_files() == set(), "the old helpers' /dev/shm files must be removed"
        wait_until(lambda: status(state_dir).get("state") == "ready", timeout=20)
        wait_until(lambda: len(_helpers(state_dir)) == 2, timeout=10)
        assert set(_processes(state_dir)).isdisjoint(old)
    finally:
        code = supervisor.stop()
    assert code == 0
    assert fake_shm_files() - before == set()
    assert _processes(state_dir) == []


def test_the_status_stops_saying_ready_as_soon_as_vllm_dies(state_dir: Path) -> None:
    # The helpers ignore SIGTERM, so the reaper takes the whole stop grace (8 s) to end the group after vLLM's
    # stand-in dies; `engine status` must not say READY through that time.
    port = free_port()
    supervisor = start_supervisor(
        state_dir, port, NEMOTRON_ENGINE__EXTRA_ARGS=THREE_PROCESSES, NEMOTRON_ENGINE__STOP_GRACE="8"
    )
    try:
        wait_until(lambda: len(_helpers(state_dir)) == 2, timeout=10, message="the helpers are not watched")
        assert status(state_dir)["state"] == "ready"
        engine = int(str(status(state_dir)["engine_pid"]))
        os.kill(engine, signal.SIGKILL)
        wait_until(lambda: status(state_dir)["state"] != "ready", timeout=4, message="READY after vLLM died")
        assert status(state_dir)["restarts"] == 0, "seen before the group is down, not only at the restart"
        assert f"engine process {engine} exited" in str(status(state_dir)["reason"])
        wait_until(lambda: status(state_dir).get("restarts") == 1, timeout=20, message=supervisor.log_text()[-3000:])
        wait_until(lambda: status(state_dir).get("state") == "ready", timeout=20)
    finally:
        code = supervisor.stop()
    assert code == 0


def _start_with_helpers(state_dir: Path, port: int) -> ServerProcess:
    """A supervised engine of three processes (stop grace 2 s), once all three are watched."""
    supervisor = start_supervisor(
        state_dir, port, NEMOTRON_ENGINE__EXTRA_ARGS=THREE_PROCESSES, NEMOTRON_ENGINE__STOP_GRACE="2"
    )
    try:
        wait_until(lambda: len(_helpers(state_dir)) == 2, timeout=10, message="the helpers are not watched")
    except BaseException:
        supervisor.stop()
        raise
    return supervisor


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def test_kill_9_of_the_reaper_alone_ends_its_group_and_restarts_the_engine(state_dir: Path) -> None:
    # The reaper is the only process that would end the engine's group; killed alone, it leaves vLLM serving with
    # nobody to stop it, so the supervisor ends that group itself and starts a new engine on a free port.
    port = free_port()
    before = fake_shm_files()
    supervisor = _start_with_helpers(state_dir, port)
    try:
        reaper = int(str(status(state_dir)["group_pid"]))
        old = group_alive(reaper)
        held = {f"fake-engine-{pid}" for pid in _helpers(state_dir)}
        assert held <= fake_shm_files()

        os.kill(reaper, signal.SIGKILL)
        wait_until(lambda: status(state_dir).get("restarts") == 1, timeout=15, message=supervisor.log_text()[-3000:])
        last = status(state_dir)["history"][-1]  # type: ignore[index]
        assert last["cause"] == "crash" and "reaper was killed" in last["reason"], last
        assert group_alive(reaper) == [], "the old engine's group must be gone before the restart"
        assert held & fake_shm_files() == set(), "the old helpers' /dev/shm files must be removed"
        wait_until(lambda: status(state_dir).get("state") == "ready", timeout=20)
        wait_until(lambda: len(_helpers(state_dir)) == 2, timeout=10)
        assert set(_processes(state_dir)).isdisjoint(old)
        assert status(state_dir)["restarts"] == 1, supervisor.log_text()[-3000:]
    finally:
        code = supervisor.stop()
    assert code == 0
    assert fake_shm_files() - before == set()


def test_stop_just_after_the_reaper_was_killed_leaves_no_process_and_frees_the_port(state_dir: Path) -> None:
    port = free_port()
    before = fake_shm_files()
    supervisor = _start_with_helpers(state_dir, port)
    try:
        reaper = int(str(status(state_dir)["group_pid"]))
        assert _listening(port)
        os.kill(reaper, signal.SIGKILL)
    finally:
        code = supervisor.stop()
    assert code == 0, supervisor.log_text()[-3000:]
    assert group_alive(reaper) == [], "a process of the engine outlived the supervisor's stop"
    assert not _listening(port), "the engine's port is still held"
    assert fake_shm_files() - before == set()
