"""Choosing the engine's GPUs and its parallel sizes: the argv, the environment, the doctor's view, `engine status`."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gateway.doctor import doctor_config
from gateway.engine.launch import MULTICAST_OFF, engine_environment
from gateway.engine.profiles import Profile, build_argv, load_profiles, select_profile
from gateway.engine.supervisor_state import EngineState, EngineStatus, parallel_size, sequence_slots
from gateway.settings import EngineSettings, Settings
from gateway.supervisor.cli import print_argv, show_status

pytestmark = pytest.mark.timeout(30)

LAUNCHER = ["vllm-serve"]
TP4 = Profile("tp4", "", {"tensor-parallel-size": 4, "max-num-seqs": 64})


def test_the_operators_parallel_sizes_come_after_the_profiles() -> None:
    engine = EngineSettings(model="m", tensor_parallel_size=2, data_parallel_size=2, extra_args=("--seed", "1"))
    argv = build_argv(LAUNCHER, engine, TP4)
    assert argv[-6:] == ["--tensor-parallel-size", "2", "--data-parallel-size", "2", "--seed", "1"]
    assert parallel_size(argv, "--tensor-parallel-size") == 2  # vLLM takes the last one
    assert sequence_slots(argv) == 128  # 64 on each of the two data-parallel ranks
    assert "--data-parallel-size" not in build_argv(LAUNCHER, EngineSettings(model="m"), TP4)


def test_the_engine_gets_its_gpus_and_nvlink_multicast_off() -> None:
    profile = select_profile(load_profiles(), "balanced")
    env = engine_environment(profile, base={"PATH": "/bin"}, gpus="2,3")
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert {k: env[k] for k in MULTICAST_OFF} == {
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NVSHMEM_DISABLE_NVLS": "1",
    }
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"  # CUDA's numbers are then nvidia-smi's and NVML's
    # The operator's own choice stands; without NEMOTRON_ENGINE__GPUS an inherited CUDA_VISIBLE_DEVICES stays.
    mine = engine_environment(profile, base={"NCCL_NVLS_ENABLE": "1", "CUDA_VISIBLE_DEVICES": "1"})
    assert (mine["NCCL_NVLS_ENABLE"], mine["CUDA_VISIBLE_DEVICES"]) == ("1", "1")


def test_the_doctor_checks_the_gpus_and_sizes_the_supervisor_would_start_with() -> None:
    engine = EngineSettings(model="m", gpus="0,1", tensor_parallel_size=2, data_parallel_size=1)
    config = doctor_config(Settings(engine=engine), select_profile(load_profiles(), "balanced"))
    assert (config.parallel.tensor, config.parallel.data, config.parallel.gpus) == (2, 1, 2)
    assert config.engine_env["CUDA_VISIBLE_DEVICES"] == "0,1"
    if "NCCL_NVLS_ENABLE" not in os.environ:
        assert config.engine_env["NCCL_NVLS_ENABLE"] == "0"


def test_print_argv_shows_the_gpus_and_the_parallel_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    engine = EngineSettings(model="m", gpus="0,1", tensor_parallel_size=2, launcher=("vllm-serve",))
    assert print_argv(Settings(engine=engine)) == 0
    out = capsys.readouterr().out
    assert "--tensor-parallel-size 2" in out and "CUDA_VISIBLE_DEVICES=0,1\n" in out


def test_engine_status_lists_the_engines_processes_and_gpus(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    me = os.getpid()
    status = EngineStatus(
        state=EngineState.READY, processes=[me, 2**22 + 9], gpus="0,1", tensor_parallel_size=2, engine_pid=me
    )
    status.write(tmp_path / "engine.json")
    assert show_status(EngineSettings(state_dir=tmp_path), as_json=False) == 0
    out = capsys.readouterr().out
    name = Path(f"/proc/{me}/comm").read_text().strip()
    assert f"processes       {me} {name}\n" in out  # the one that has ended is left out
    assert "GPUs            0,1 (tensor parallel 2, data parallel 1)\n" in out
    show_status(EngineSettings(state_dir=tmp_path), as_json=True)
    assert json.loads(capsys.readouterr().out)["processes"] == [me, 2**22 + 9]
