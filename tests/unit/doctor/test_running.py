"""Our running engine next to a hand-run doctor: a port held by it (the pid the supervisor's status file names,
or a process below it) is not a conflict; a port held by anything else still is."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.doctor.check import Check, Status
from gateway.doctor.runner import DoctorConfig, run_checks
from gateway.doctor.running import descendants, listening_inodes, running_engine
from gateway.engine.supervisor_state import EngineState, EngineStatus
from tests.procs import ServerProcess, free_port, run_fake_engine
from tests.unit.doctor.samples import by_name

pytestmark = pytest.mark.timeout(60)

# A parent that starts the fake engine as its child and waits: vLLM's API server below a guard process.
_PARENT = "import subprocess, sys; subprocess.run(sys.argv[1:], check=False)"


@pytest.fixture
def engine() -> Iterator[ServerProcess]:
    """A running fake engine: what `make run` leaves listening on the engine port."""
    proc = run_fake_engine()
    try:
        yield proc
    finally:
        proc.stop()


def write_status(path: Path, engine_pid: int | None, state: EngineState = EngineState.READY) -> Path:
    # supervisor_pid: a pid that is no ancestor of anything here (the test process would be everyone's).
    EngineStatus(state=state, engine_pid=engine_pid, supervisor_pid=1).write(path)
    return path


def port_row(port: int, status_file: Path | None) -> Check:
    config = DoctorConfig(engine_port=port, engine_status_file=status_file, cpu=True, environ={})
    return by_name(run_checks(config))["engine port"]


def test_port_held_by_our_engine_passes(tmp_path: Path, engine: ServerProcess) -> None:
    assert engine.port is not None
    status = write_status(tmp_path / "engine.json", engine.pid)
    row = port_row(engine.port, status)
    assert row.status is Status.PASS, row
    assert row.measured == f"127.0.0.1:{engine.port} held by the running engine (pid {engine.pid}, ready)"


def test_port_held_by_a_child_of_our_engine_passes(tmp_path: Path) -> None:
    port = free_port()
    child = [sys.executable, "-m", "tests.fakes.fake_engine", "--port", str(port)]
    guard = ServerProcess([sys.executable, "-c", _PARENT, *child], ready_url=f"http://127.0.0.1:{port}/health")
    with guard:
        engine = running_engine(write_status(tmp_path / "engine.json", guard.pid))
        assert engine is not None and engine.state == "ready"
        owner = engine.port_owner(port)
        assert owner is not None and owner.pid != guard.pid
        assert owner.pid in descendants([guard.pid])
        assert port_row(port, tmp_path / "engine.json").status is Status.PASS


def test_port_held_by_a_stranger_still_fails(tmp_path: Path, engine: ServerProcess) -> None:
    stranger = run_fake_engine()
    try:
        assert stranger.port is not None
        # The status file names our engine, which listens elsewhere: the stranger's port is no one's of ours.
        row = port_row(stranger.port, write_status(tmp_path / "engine.json", engine.pid))
        assert row.blocks_start and "in use" in row.measured
        assert port_row(stranger.port, tmp_path / "absent.json").blocks_start  # no stack running
        assert port_row(stranger.port, write_status(tmp_path / "none.json", None)).blocks_start  # no engine yet
    finally:
        stranger.stop()


def test_the_supervisors_own_preflight_still_refuses_a_taken_port(tmp_path: Path, engine: ServerProcess) -> None:
    # Without the status file (the supervisor about to start its engine), a running engine is a conflict:
    # a second vLLM on the port would exit after ~23 s.
    assert engine.port is not None
    write_status(tmp_path / "engine.json", engine.pid)
    assert port_row(engine.port, None).blocks_start


def test_listening_inodes_read_from_proc(tmp_path: Path) -> None:
    net = tmp_path / "net"
    net.mkdir()
    header = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
    listen = "   0: 0100007F:1F41 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4242 1\n"
    client = "   1: 0100007F:1F41 0100007F:9C40 01 00000000:00000000 00:00000000 00000000     0        0 4343 1\n"
    (net / "tcp").write_text(header + listen + client)
    assert listening_inodes(8001, tmp_path) == {4242}
    assert listening_inodes(8002, tmp_path) == set()


def test_no_running_engine_without_a_live_pid(tmp_path: Path) -> None:
    assert running_engine(tmp_path / "absent.json") is None
    assert running_engine(write_status(tmp_path / "none.json", None)) is None
    gone = ServerProcess([sys.executable, "-c", "pass"]).start(wait=False)
    gone.stop()
    assert running_engine(write_status(tmp_path / "gone.json", gone.pid)) is None
