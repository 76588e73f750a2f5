"""Managed replicas of one host: which ones a process runs, each one's GPUs, port, state dir, argv and status."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gateway.doctor.cli import main as doctor_main
from gateway.engine.launch import prepare
from gateway.engine.profiles import ProfileError
from gateway.engine.replicas import (
    available_gpus,
    gpus_per_replica,
    replica_gpus,
    replica_indices,
    replica_settings,
    split_gpus,
)
from gateway.engine.supervisor_state import (
    RESTART_REQUEST,
    EngineState,
    EngineStatus,
    request_restart,
    take_restart_request,
)
from gateway.settings import EngineSettings, Settings
from gateway.supervisor.cli import show_status, write_running_env

pytestmark = pytest.mark.timeout(30)

LAUNCHER = ("vllm-serve",)
GPU_ARGV = ["vllm-serve", "--gpu-memory-utilization", "0.9", "--tensor-parallel-size", "2"]


def test_a_process_runs_every_replica_or_only_the_one_named() -> None:
    assert replica_indices(EngineSettings()) == [0]
    assert replica_indices(EngineSettings(replicas=3)) == [0, 1, 2]
    assert replica_indices(EngineSettings(replicas=3, replica=2)) == [2]


def test_the_gpus_split_in_order_into_groups_of_the_parallel_size() -> None:
    assert split_gpus(["0", "1", "2", "3"], 2, 2) == ["0,1", "2,3"]
    assert split_gpus(["0", "1", "2", "3", "4"], 1, 4) == ["0", "1", "2", "3"]  # GPU 4 stays free
    assert gpus_per_replica([*GPU_ARGV, "--data-parallel-size", "2", "--pipeline-parallel-size", "2"]) == 8
    assert gpus_per_replica(["vllm-serve"]) == 1


def test_too_few_gpus_refuse_the_start_naming_what_is_missing() -> None:
    with pytest.raises(ProfileError) as refused:
        split_gpus(["0", "1", "2"], 2, 2)
    message = str(refused.value)
    assert "2 engine replicas of 2 GPU(s) each" in message and "need 4 GPUs; 3 available (GPUs: 0,1,2)" in message
    with pytest.raises(ProfileError, match="0 available"):
        replica_gpus(EngineSettings(replicas=2), GPU_ARGV, environ={}, machine_gpus=list)


def test_the_gpus_come_from_the_setting_else_the_inherited_variable_else_nvml() -> None:
    machine = lambda: ["0", "1", "2", "3"]  # noqa: E731 - NVML's answer, recorded
    assert available_gpus(EngineSettings(gpus="4, 5"), {"CUDA_VISIBLE_DEVICES": "1"}, machine) == ["4", "5"]
    assert available_gpus(EngineSettings(), {"CUDA_VISIBLE_DEVICES": "2,3"}, machine) == ["2", "3"]
    assert available_gpus(EngineSettings(), {}, machine) == ["0", "1", "2", "3"]
    engine = EngineSettings(replicas=2)
    assert replica_gpus(engine, GPU_ARGV, {}, machine) == ["0,1", "2,3"]
    uuids = EngineSettings(replicas=2, gpus="GPU-a,GPU-b")
    assert replica_gpus(uuids, ["vllm-serve", "--gpu-memory-utilization", "0.9"], {}, machine) == ["GPU-a", "GPU-b"]


def test_one_replica_or_the_cpu_keeps_the_engines_own_gpus() -> None:
    nvml_never = lambda: pytest.fail("NVML is not read")  # noqa: E731
    assert replica_gpus(EngineSettings(gpus="3"), GPU_ARGV, {}, nvml_never) == ["3"]
    cpu_argv = ["vllm-serve", "--dtype", "float32"]  # the CPU profile sets no GPU memory share
    assert replica_gpus(EngineSettings(replicas=2), cpu_argv, {}, nvml_never) == [None, None]


def test_each_replica_gets_its_own_port_state_dir_gpus_and_argv(tmp_path: Path) -> None:
    engine = EngineSettings(model="m", replicas=2, state_dir=tmp_path, launcher=LAUNCHER)
    settings = Settings(engine=engine)
    for index, gpus in enumerate(["0,1", "2,3"]):
        own = replica_settings(settings, index, gpus)
        assert own.engine.port == 8001 + index
        assert own.engine.state_dir == (tmp_path if index == 0 else tmp_path / "replica-1")
        _, argv, env = prepare(own)
        assert argv[argv.index("--port") + 1] == str(8001 + index)
        assert env["CUDA_VISIBLE_DEVICES"] == gpus
    assert settings.engine.port == 8001 and settings.engine.gpus is None  # the host's settings are untouched


def test_each_replica_writes_its_run_env_naming_itself(tmp_path: Path) -> None:
    settings = Settings(engine=EngineSettings(model="m", replicas=2, state_dir=tmp_path))
    write_running_env(settings, 1)
    written = (tmp_path / "replica-1" / "run.env").read_text()
    assert 'NEMOTRON_ENGINE__REPLICA="1"' in written and 'NEMOTRON_ENGINE__REPLICAS="2"' in written
    assert 'NEMOTRON_ENGINE__PORT="8001"' in written  # the host's: every replica's port follows from it
    again = Settings(_env_file=tmp_path / "replica-1" / "run.env")  # type: ignore[call-arg]  # pydantic-settings' init
    assert again.engine.replica == 1 and again.engine.replica_port(1) == 8002


def test_engine_status_reports_every_replica(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    engine = EngineSettings(replicas=2, state_dir=tmp_path)
    me = os.getpid()
    ready = EngineStatus(state=EngineState.READY, engine_pid=me, gpus="0", engine_url="http://127.0.0.1:8001")
    ready.write(tmp_path / "engine.json")
    assert show_status(engine, as_json=True) == 1  # replica 1 has no status yet
    answer = json.loads(capsys.readouterr().out)
    assert answer["ready"] is False
    assert [(r["replica"], r["port"], r["state"]) for r in answer["replicas"]] == [(0, 8001, "ready"), (1, 8002, None)]
    restarting = EngineStatus(state=EngineState.RESTARTING, reason="crash: exited", restarts=1, gpus="1")
    restarting.write(tmp_path / "replica-1" / "engine.json")
    assert show_status(engine, as_json=False) == 1
    text = capsys.readouterr().out
    assert "replica 0 (port 8001)\n  state           ready\n" in text
    assert "replica 1 (port 8002)\n  state           restarting\n  reason          crash: exited\n" in text
    assert "  GPUs            1 (tensor parallel 1, data parallel 1)\n" in text
    restarting.state = EngineState.READY
    restarting.write(tmp_path / "replica-1" / "engine.json")
    assert show_status(engine, as_json=True) == 0
    assert show_status(engine.model_copy(update={"replica": 1}), as_json=True) == 0
    assert [r["replica"] for r in json.loads(capsys.readouterr().out.splitlines()[-1])["replicas"]] == [1]


def test_a_restart_request_is_a_file_taken_once(tmp_path: Path) -> None:
    assert not take_restart_request(tmp_path)
    path = request_restart(tmp_path / "replica-1")
    assert path == tmp_path / "replica-1" / RESTART_REQUEST and path.is_file()
    assert take_restart_request(tmp_path / "replica-1")
    assert not take_restart_request(tmp_path / "replica-1")


def test_the_doctor_checks_each_replicas_gpus_and_port(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name, value in {
        "NEMOTRON_ENGINE__REPLICAS": "2",
        "NEMOTRON_ENGINE__PORT": "18001",
        "NEMOTRON_ENGINE__PROFILE": "cpu-dev",
        "NEMOTRON_ENGINE__STATE_DIR": str(tmp_path),
    }.items():
        monkeypatch.setenv(name, value)
    doctor_main(["--json"])
    checks = {check["name"]: check for check in json.loads(capsys.readouterr().out)["checks"]}
    assert "127.0.0.1:18001" in checks["engine port (replica 0)"]["measured"]
    assert "127.0.0.1:18002" in checks["engine port (replica 1)"]["measured"]
    assert {"NVIDIA GPU (replica 0)", "NVIDIA GPU (replica 1)", "Redis", "model directory"} <= checks.keys()
    assert "engine port" not in checks and "model directory (replica 1)" not in checks  # the model's rows once
