"""GPU checks with fed values, NVML through a stand-in library, and the GPU rows of a full run."""

from __future__ import annotations

import argparse
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from gateway.doctor import rows, runner
from gateway.doctor.check import NO_GPU, Status, passed, worst
from gateway.doctor.gpu import (
    FlashAttnBuild,
    TorchBuild,
    check_compute_capability,
    check_cuda_visible_devices,
    check_device_nodes,
    check_driver_vs_torch,
    check_flash_attn,
    check_gpu_memory,
    check_gpu_present,
    check_pcie,
    read_torch_build,
)
from gateway.doctor.runner import run_checks
from gateway.engine import nvml
from gateway.engine.nvml import GpuLink, GpuProcess, GpuReadings, PcieLink
from gateway.engine.supervisor_state import EngineState, EngineStatus
from tests.unit.doctor.samples import GiB, by_name, doctor_config_for, h200

pytestmark = pytest.mark.timeout(30)


def test_driver_older_major_than_torch_cuda_fails_fatally() -> None:
    check = check_driver_vs_torch((12, 2), "13.0", "535.104", "2.11.0+cu130")
    assert (check.status, check.fatal) == (Status.FAIL, True)
    assert "CUDA 12.2" in check.measured and "CUDA 13.0" in check.measured
    assert "580" in check.fix


@pytest.mark.parametrize(
    ("driver", "torch_cuda", "status"),
    [((13, 0), "13.0", Status.PASS), ((13, 1), "13.0", Status.PASS), ((12, 2), "12.4", Status.WARN)],
)
def test_driver_vs_torch_boundaries(driver: tuple[int, int], torch_cuda: str, status: Status) -> None:
    assert check_driver_vs_torch(driver, torch_cuda).status is status


def test_driver_vs_torch_without_gpu_or_cuda_torch() -> None:
    assert check_driver_vs_torch(None, "13.0").measured == NO_GPU
    cpu_torch = check_driver_vs_torch((13, 0), None, "580.159.04", "2.13.0+cpu")
    assert cpu_torch.status is Status.WARN and "CPU-only" in cpu_torch.measured
    assert "not installed" in check_driver_vs_torch((13, 0), None).measured


@pytest.mark.parametrize(
    ("cc", "archs", "status"),
    [
        ((8, 0), {"sm90"}, Status.FAIL),
        ((9, 0), {"sm80"}, Status.FAIL),  # sm80 code does not run on 9.0
        ((9, 0), {"sm80", "sm90"}, Status.PASS),
        ((8, 6), {"sm80"}, Status.PASS),  # same major, newer minor runs it
        ((8, 0), {"sm86"}, Status.FAIL),
        ((9, 0), {"sm_90a"}, Status.PASS),
        ((9, 0), {"9.0"}, Status.PASS),
        ((10, 0), {"sm80", "compute80", "sm90"}, Status.WARN),  # PTX only: JIT
        ((7, 5), {"sm75", "sm80"}, Status.FAIL),  # FlashAttention needs Ampere
        ((9, 0), None, Status.WARN),
    ],
)
def test_compute_capability_vs_flash_attn_archs(cc: tuple[int, int], archs: set[str] | None, status: Status) -> None:
    check = check_compute_capability(cc, archs)
    assert check.status is status, check
    assert check.fatal is False
    if status is Status.FAIL:
        assert check.fix


def test_flash_attn_not_installed_warns() -> None:
    check = check_flash_attn((9, 0), None)
    assert check.status is Status.WARN and "no flash-attn" in check.measured
    assert check_flash_attn((9, 0), FlashAttnBuild("x.so", frozenset({"sm90"}))).status is Status.PASS


def test_gpu_memory_against_utilisation() -> None:
    total = 140 * GiB
    assert check_gpu_memory(139 * GiB, total, 0.90).status is Status.PASS
    short = check_gpu_memory(100 * GiB, total, 0.90)
    assert (short.status, short.fatal) == (Status.FAIL, True)
    assert "--gpu-memory-utilization to 0.70" in short.fix
    tight = check_gpu_memory(int(126.5 * GiB), total, 0.90)  # 126.0 needed: 0.5 GiB headroom
    assert tight.status is Status.WARN


@pytest.mark.parametrize(
    ("value", "count", "uuids", "status"),
    [
        ("3", 1, (), Status.FAIL),
        ("0", 1, (), Status.PASS),
        (None, 2, (), Status.PASS),
        ("", 1, (), Status.FAIL),
        ("-1", 1, (), Status.FAIL),
        ("0,5", 2, (), Status.WARN),  # CUDA drops 5 and anything after it
        ("0,0", 2, (), Status.WARN),
        ("GPU-8f1a2b3c-0000-1111-2222-333344445555", 1, (), Status.PASS),  # UUIDs unknown: form accepted
        ("GPU-8f1a", 1, ("GPU-8f1a2b3c-0000-1111-2222-333344445555",), Status.PASS),  # unique prefix
        ("GPU-dead", 1, ("GPU-8f1a2b3c-0000-1111-2222-333344445555",), Status.FAIL),
        ("MIG-4b8e3f1c-1111-2222-3333-444455556666", 1, (), Status.PASS),
        ("1, 0", 2, (), Status.PASS),
    ],
)
def test_cuda_visible_devices(value: str | None, count: int, uuids: tuple[str, ...], status: Status) -> None:
    check = check_cuda_visible_devices(value, count, uuids)
    assert check.status is status, check
    assert check.fatal is True


def test_cuda_visible_devices_naming_no_gpu_says_so() -> None:
    check = check_cuda_visible_devices("3", 1)
    assert "names no GPU" in check.measured and check.blocks_start
    assert check_cuda_visible_devices("0", 0).measured == NO_GPU


@pytest.mark.parametrize(
    ("link", "status"),
    [
        ((4, 8, 4, 16), Status.WARN),
        ((4, 16, 4, 16), Status.PASS),
        ((5, 16, 5, 16), Status.PASS),
        ((3, 16, 3, 16), Status.WARN),  # the slot tops out at gen3
        ((1, 16, 5, 16), Status.PASS),  # an idle link trains down to gen1
        ((5, 16, 5, 8), Status.WARN),
        ((None, None, None, None), Status.WARN),
    ],
)
def test_pcie_link(link: tuple[int | None, ...], status: Status) -> None:
    check = check_pcie(*link)
    assert check.status is status, check
    assert check.fatal is False


def test_pcie_gen4_x8_names_the_fix() -> None:
    check = check_pcie(4, 8, 4, 16)
    assert check.measured == "gen4 x8 (max gen4 x16)"
    assert "x16" in check.fix and "pcie-limited" in check.fix


def test_device_nodes() -> None:
    ok = {"/dev/nvidia0": True, "/dev/nvidiactl": True, "/dev/nvidia-uvm": True}
    assert check_device_nodes(ok, gpu_present=True).status is Status.PASS
    assert check_device_nodes({}, gpu_present=False).measured == NO_GPU
    closed = check_device_nodes({**ok, "/dev/nvidia0": False}, gpu_present=True)
    assert closed.status is Status.FAIL and "/dev/nvidia0" in closed.measured and "cgroup" in closed.fix
    no_uvm = check_device_nodes({"/dev/nvidia0": True, "/dev/nvidiactl": True}, gpu_present=True)
    assert no_uvm.status is Status.WARN and "nvidia-modprobe" in no_uvm.fix


def test_gpu_presence_by_profile() -> None:
    none = GpuReadings()
    assert check_gpu_present(none, cpu_profile=True).measured == NO_GPU
    missing = check_gpu_present(none, cpu_profile=False)
    assert missing.blocks_start
    broken = check_gpu_present(GpuReadings(error="NVML init failed: Unknown Error"), cpu_profile=False)
    assert broken.status is Status.FAIL and "Unknown Error" in broken.measured
    found = check_gpu_present(GpuReadings("580.159.04", (13, 0), (h200(), h200(1))), cpu_profile=False)
    assert found.status is Status.PASS and "2 x NVIDIA H200" in found.measured


def test_worst_merges_per_gpu_rows() -> None:
    merged = worst(rows.PCIE, [check_pcie(5, 16, 5, 16), check_pcie(4, 8, 4, 16)], ["GPU 0", "GPU 1"])
    assert merged.status is Status.WARN
    assert merged.measured.startswith("GPU 0: gen5 x16") and "GPU 1: gen4 x8" in merged.measured
    assert worst(rows.FLASH_ATTN, [passed(rows.PCIE, "one")], ["GPU 0"]).name == "compute capability vs flash-attn"


def test_torch_build_is_read_without_importing_torch() -> None:
    build = read_torch_build()  # this machine may have no torch; the shape holds either way
    assert build is None or build.version


class FakeNvml:
    """The pynvml calls `nvml.read_gpus` makes, answering like one H200 whose PCIe getters are unsupported."""

    class NVMLError(Exception):
        pass

    def __init__(self, count: int = 1, init_error: bool = False) -> None:
        self.count, self.init_error, self.shut_down = count, init_error, False

    def nvmlInit(self) -> None:
        if self.init_error:
            raise self.NVMLError("Driver Not Loaded")

    def nvmlShutdown(self) -> None:
        self.shut_down = True

    def nvmlSystemGetDriverVersion(self) -> bytes:
        return b"580.159.04"

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return 13000

    def nvmlDeviceGetCount(self) -> int:
        return self.count

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:
        return argparse.Namespace(free=140 * GiB, total=141 * GiB)

    def nvmlDeviceGetCudaComputeCapability(self, handle: int) -> tuple[int, int]:
        return (9, 0)

    def nvmlDeviceGetName(self, handle: int) -> str:
        return "NVIDIA H200"

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return f"GPU-{handle}f1a2b3c-0000"

    def nvmlDeviceGetPciInfo(self, handle: int) -> Any:
        return argparse.Namespace(busId=b"00000000:18:00.0")

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[Any]:
        # GPU 0: vLLM's 120 GiB; GPU 1: a process whose usage the (virtualised) driver does not report.
        return [argparse.Namespace(pid=4242 + handle, usedGpuMemory=120 * GiB if handle == 0 else None)]

    def nvmlDeviceGetMinorNumber(self, handle: int) -> int:
        return handle

    def nvmlDeviceGetTopologyCommonAncestor(self, first: int, second: int) -> int:
        raise self.NVMLError("Not Supported")

    def nvmlDeviceGetP2PStatus(self, first: int, second: int, index: int) -> int:
        raise self.NVMLError("Not Supported")

    def _unsupported(self, handle: int) -> int:
        raise self.NVMLError("Not Supported")

    nvmlDeviceGetCurrPcieLinkGeneration = _unsupported
    nvmlDeviceGetCurrPcieLinkWidth = _unsupported
    nvmlDeviceGetMaxPcieLinkGeneration = _unsupported
    nvmlDeviceGetMaxPcieLinkWidth = _unsupported


def test_read_gpus_through_nvml_with_the_pcie_link_from_sysfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    device = tmp_path / "0000:18:00.0"
    device.mkdir()
    for name, value in {
        "current_link_speed": "16.0 GT/s PCIe",
        "current_link_width": "8",
        "max_link_speed": "32.0 GT/s PCIe",
        "max_link_width": "16",
    }.items():
        (device / name).write_text(value + "\n")
    fake = FakeNvml(count=2)
    monkeypatch.setattr(nvml, "pynvml", fake)
    monkeypatch.setattr(nvml, "_SYSFS_PCI", tmp_path)
    readings = nvml.read_gpus()
    assert (readings.driver_version, readings.cuda_driver, readings.error) == ("580.159.04", (13, 0), None)
    assert [d.uuid for d in readings.devices] == ["GPU-0f1a2b3c-0000", "GPU-1f1a2b3c-0000"]
    assert readings.devices[0].pcie == PcieLink(4, 8, 5, 16)
    assert readings.devices[0].compute_capability == (9, 0) and fake.shut_down
    assert [d.processes for d in readings.devices] == [(GpuProcess(4242, 120 * GiB),), (GpuProcess(4243, None),)]
    assert readings.links == (GpuLink(0, 1, nvlink=False, peer_access=False, topology=None),)  # NVML said nothing


def test_read_gpus_without_a_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nvml, "pynvml", FakeNvml(init_error=True))
    readings = nvml.read_gpus()
    assert readings.devices == ()
    monkeypatch.setattr(nvml, "pynvml", None)
    assert nvml.read_gpus().devices == ()


def test_gpu_rows_on_a_gpu_machine(tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    readings = GpuReadings("580.159.04", (13, 0), (h200(0), h200(1)))
    monkeypatch.setattr(runner, "read_gpus", lambda: readings)
    nodes = {"/dev/nvidia0": True, "/dev/nvidia1": True, "/dev/nvidiactl": True, "/dev/nvidia-uvm": True}
    monkeypatch.setattr(runner, "device_nodes", lambda: nodes)
    monkeypatch.setattr(runner, "read_torch_build", lambda: TorchBuild("2.11.0+cu130", "13.0", "/site/torch"))
    monkeypatch.setattr(runner, "flash_attn_libraries", lambda: [])
    environ = {"HF_HUB_CACHE": str(tmp_path / "hf"), "CUDA_VISIBLE_DEVICES": "1"}
    rows = by_name(run_checks(doctor_config_for(tmp_path, redis_url, cpu=False, environ=environ)))
    assert rows["NVIDIA GPU"].measured == "2 x NVIDIA H200; driver 580.159.04"
    assert rows["driver vs torch CUDA"].status is Status.PASS
    assert rows["compute capability vs flash-attn"].status is Status.WARN  # no vLLM kernels in this Python
    assert rows["GPU memory free"].status is Status.PASS
    assert rows["CUDA_VISIBLE_DEVICES"].measured == "'1': 1 of 2 GPU(s)"
    assert rows["PCIe link"].measured == "gen5 x16 (max gen5 x16)"  # GPU 1 only: the one CUDA will use
    assert rows["GPU device nodes"].status is Status.PASS
    cpu_rows = by_name(run_checks(doctor_config_for(tmp_path, redis_url, cpu=True, environ=environ)))
    assert cpu_rows["GPU memory free"].measured == "skipped: CPU profile"


def test_gpu_memory_held_by_our_running_engine_counts_as_free(
    tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A hand-run doctor next to the running engine: vLLM holds 0.9 of the GPU, 14 GiB are free.
    engine_pid = os.getpid()  # any live process stands in for vLLM
    busy = replace(h200(0), memory_free=14 * GiB, processes=(GpuProcess(engine_pid, 126 * GiB), GpuProcess(1, None)))
    monkeypatch.setattr(runner, "read_gpus", lambda: GpuReadings("580.159.04", (13, 0), (busy,)))
    status_file = tmp_path / "engine.json"
    EngineStatus(state=EngineState.READY, engine_pid=engine_pid).write(status_file)
    config = doctor_config_for(tmp_path, redis_url, cpu=False, environ={"HF_HUB_CACHE": str(tmp_path / "hf")})
    alone = by_name(run_checks(config))["GPU memory free"]
    assert alone.blocks_start  # the supervisor's own preflight: a second engine would not fit
    ours = by_name(run_checks(replace(config, engine_status_file=status_file)))["GPU memory free"]
    assert ours.status is Status.PASS, ours
    assert ours.measured.startswith("14.0 GiB free of 141.0 GiB (+126.0 GiB held by the running engine)")
    EngineStatus(state=EngineState.READY, engine_pid=None).write(status_file)  # an engine not ours: no credit
    assert by_name(run_checks(replace(config, engine_status_file=status_file)))["GPU memory free"].blocks_start
