"""The doctor's rows for an engine on several GPUs: each check on fed NVML answers, NVML's link readings through a
stand-in library, and the rows of a full run on a recorded four-GPU host."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from gateway.doctor import multigpu, runner
from gateway.doctor.check import Status
from gateway.doctor.flags import parse_flags
from gateway.doctor.multigpu import (
    Parallelism,
    check_gpu_access,
    check_nccl_environment,
    check_other_processes,
    check_parallel_gpus,
    check_peer_links,
    network_interfaces,
)
from gateway.doctor.runner import run_checks
from gateway.engine import nvml
from gateway.engine.launch import MULTICAST_OFF
from gateway.engine.nvml import GpuLink, GpuProcess, GpuReadings, Topology, open_error
from tests.unit.doctor.samples import GiB, by_name, doctor_config_for, h200
from tests.unit.doctor.test_gpu import FakeNvml

pytestmark = pytest.mark.timeout(30)

FOUR = tuple(replace(h200(i), minor=i) for i in range(4))
# GPUs 0-1 on NVLink; 2-3 on one PCIe switch with peer access; 0/1 to 2/3 across NUMA nodes without it.
LINKS = (
    GpuLink(0, 1, nvlink=True, peer_access=True, topology=Topology.SINGLE),
    GpuLink(0, 2, nvlink=False, peer_access=False, topology=Topology.SYSTEM),
    GpuLink(0, 3, nvlink=False, peer_access=False, topology=Topology.SYSTEM),
    GpuLink(1, 2, nvlink=False, peer_access=False, topology=Topology.SYSTEM),
    GpuLink(1, 3, nvlink=False, peer_access=False, topology=Topology.SYSTEM),
    GpuLink(2, 3, nvlink=False, peer_access=True, topology=Topology.SINGLE),
)
READINGS = GpuReadings("580.159.04", (13, 0), FOUR, links=LINKS)


def test_the_argv_parallel_sizes_in_long_and_short_forms() -> None:
    flags = parse_flags(["--model", "m", "-tp", "2", "--data-parallel-size=2", "--pipeline-parallel-size", "1"])
    assert (flags.tensor_parallel_size, flags.data_parallel_size, flags.pipeline_parallel_size) == (2, 2, 1)
    assert parse_flags(["--model", "m"]).tensor_parallel_size == 1
    assert Parallelism(tensor=2, data=4, data_local=2).gpus == 4  # the other two ranks run on another host


def test_too_few_gpus_for_the_parallel_sizes_is_fatal_with_the_setting_that_fixes_it() -> None:
    tp2 = Parallelism(tensor=2)
    short = check_parallel_gpus(tp2, FOUR[1:2], gpu_count=4)
    assert short.blocks_start
    assert "needs 2 GPU(s); the engine sees 1 (GPU 1)" in short.measured and "NEMOTRON_ENGINE__GPUS" in short.fix
    too_big = check_parallel_gpus(Parallelism(tensor=4, data=2), FOUR, gpu_count=4)
    assert too_big.blocks_start and "this host has 4 GPU(s)" in too_big.fix
    assert check_parallel_gpus(tp2, FOUR[:2], gpu_count=4).status is Status.PASS
    spare = check_parallel_gpus(tp2, FOUR, gpu_count=4)
    assert spare.status is Status.PASS and "uses the first 2" in spare.fix
    assert check_parallel_gpus(tp2, (), gpu_count=0).status is Status.SKIP


def test_a_gpu_the_cgroup_refuses_is_fatal_though_nvml_lists_it(tmp_path: Path) -> None:
    # The open is what a devices cgroup refuses (EPERM); os.access reads only the mode bits and would pass it.
    node = tmp_path / "nvidia0"
    node.write_text("")
    assert open_error(node) is None
    assert open_error(tmp_path / "nvidia1") == "No such file or directory"
    refused = check_gpu_access(FOUR[:2], {0: None, 1: "Operation not permitted"})
    assert refused.blocks_start
    assert refused.measured == "GPU 0 open; refused: GPU 1: Operation not permitted"
    assert "devices cgroup" in refused.fix and "NEMOTRON_ENGINE__GPUS" in refused.fix
    assert check_gpu_access(FOUR[:2], {0: None, 1: None}).status is Status.PASS
    assert check_gpu_access(FOUR[:2], {0: None}).status is Status.WARN  # GPU 1's minor number unknown


def test_peer_links_pass_on_nvlink_and_warn_without_peer_access() -> None:
    tp2 = Parallelism(tensor=2)
    nvlink = check_peer_links(tp2, FOUR[:2], READINGS)
    assert (nvlink.status, nvlink.measured) == (Status.PASS, "0-1: NVLink")
    across = check_peer_links(tp2, (FOUR[0], FOUR[2]), READINGS)
    assert across.status is Status.WARN and across.measured == "0-2: no peer access (across NUMA nodes)"
    assert "host memory" in across.fix and "--data-parallel-size" in across.fix
    pcie = check_peer_links(tp2, FOUR[2:], READINGS)
    assert pcie.status is Status.PASS and pcie.measured == "2-3: PCIe peer-to-peer (one PCIe switch)"
    # Data-parallel ranks do not all-reduce per token: no links needed.
    assert check_peer_links(Parallelism(data=2), (FOUR[0], FOUR[2]), READINGS).status is Status.PASS
    assert check_peer_links(tp2, FOUR[:1], READINGS).status is Status.SKIP


def test_nvlink_multicast_on_fails_the_nccl_row() -> None:
    interfaces = {"lo", "eth0"}
    assert check_nccl_environment({"NCCL_NVLS_ENABLE": "1"}, 2, interfaces).status is Status.FAIL
    off = check_nccl_environment(MULTICAST_OFF, 2, interfaces)
    assert off.status is Status.PASS and "NCCL_NVLS_ENABLE=0" in off.measured
    assert check_nccl_environment({"NCCL_NVLS_ENABLE": "1"}, 1, interfaces).status is Status.SKIP


@pytest.mark.parametrize(
    ("env", "status", "said"),
    [
        ({"NCCL_SOCKET_IFNAME": "ib0"}, Status.FAIL, "NCCL_SOCKET_IFNAME=ib0 matches none of eth0, lo"),
        ({"NCCL_SOCKET_IFNAME": "eth"}, Status.PASS, "no NCCL variable"),
        ({"NCCL_SOCKET_IFNAME": "=eth"}, Status.FAIL, "matches none"),
        ({"NCCL_SOCKET_IFNAME": "^lo,eth"}, Status.FAIL, "matches none"),
        ({"NCCL_SOCKET_IFNAME": "^docker"}, Status.PASS, "no NCCL variable"),
        ({"NCCL_P2P_DISABLE": "1"}, Status.WARN, "host memory"),
        ({"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}, Status.FAIL, "only sockets"),
        ({"NCCL_ALGO": "NVLS"}, Status.WARN, "NCCL_ALGO=NVLS forces"),
        ({"CUDA_LAUNCH_BLOCKING": "1"}, Status.WARN, "serialises"),
    ],
)
def test_nccl_variables_that_break_or_slow_tensor_parallel(env: dict[str, str], status: Status, said: str) -> None:
    check = check_nccl_environment({**MULTICAST_OFF, **env}, 2, {"lo", "eth0"})
    assert check.status is status and said in check.measured, check


def test_network_interfaces_read_from_sysfs(tmp_path: Path) -> None:
    for name in ("lo", "eth0"):
        (tmp_path / name).mkdir()
    assert network_interfaces(tmp_path) == {"lo", "eth0"}
    assert network_interfaces(tmp_path / "missing") == set()


def test_other_processes_on_the_engines_gpus_are_named_and_ours_are_not() -> None:
    busy = replace(FOUR[1], processes=(GpuProcess(4242, 20 * GiB), GpuProcess(77, None)))
    check = check_other_processes((FOUR[0], busy), frozenset({77}), {4242: "python3"})
    assert check.status is Status.WARN
    assert check.measured == "GPU 1: pid 4242 (python3) 20.0 GiB"
    assert "NEMOTRON_ENGINE__GPUS" in check.fix
    assert check_other_processes(FOUR[:2], frozenset(), {}).measured == "none on GPU 0, 1"


class FakeLinkedNvml(FakeNvml):
    """Four GPUs joined as LINKS says, answering the topology and peer-to-peer calls as NVML does."""

    # nvidia-ml-py 13 writes the READ index as a one-element tuple: a caller passing it would get an error.
    NVML_P2P_CAPS_INDEX_READ = (0,)

    def __init__(self) -> None:
        super().__init__(count=4)

    def nvmlDeviceGetMinorNumber(self, handle: int) -> int:
        return handle

    def _link(self, first: int, second: int) -> GpuLink:
        found = READINGS.link(first, second)
        assert found is not None
        return found

    def nvmlDeviceGetTopologyCommonAncestor(self, first: int, second: int) -> int:
        level = self._link(first, second).topology
        assert level is not None
        return int(level)

    def nvmlDeviceGetP2PStatus(self, first: int, second: int, index: Any) -> int:
        if not isinstance(index, int):
            raise self.NVMLError("Invalid Argument")
        link = self._link(first, second)
        ok = link.nvlink if index == 2 else link.peer_access
        return 0 if ok else 5  # NVML_P2P_STATUS_OK, NVML_P2P_STATUS_NOT_SUPPORTED


def test_read_gpus_reads_every_pairs_link_and_each_minor(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nvml, "pynvml", FakeLinkedNvml())
    readings = nvml.read_gpus()
    assert readings.links == LINKS
    assert [d.minor for d in readings.devices] == [0, 1, 2, 3]
    assert readings.link(1, 0) == LINKS[0]


def test_the_multi_gpu_rows_of_a_full_run(tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    stranger = replace(FOUR[1], processes=(GpuProcess(4242, 20 * GiB),))
    monkeypatch.setattr(runner, "read_gpus", lambda: replace(READINGS, devices=(FOUR[0], stranger, *FOUR[2:])))
    nodes = {f"/dev/nvidia{i}": True for i in range(4)} | {"/dev/nvidiactl": True, "/dev/nvidia-uvm": True}
    monkeypatch.setattr(runner, "device_nodes", lambda: nodes)
    # The cgroup lets this process open GPUs 0 and 1 only.
    monkeypatch.setattr(
        runner, "open_error", lambda node: None if node.name in ("nvidia0", "nvidia1") else "Operation not permitted"
    )
    monkeypatch.setattr(runner, "network_interfaces", lambda: {"lo", "eth0"})
    environ = {"HF_HUB_CACHE": str(tmp_path / "hf")}
    base = doctor_config_for(tmp_path, redis_url, cpu=False, environ=environ, parallel=Parallelism(tensor=2))
    on_two = by_name(run_checks(replace(base, engine_env={**MULTICAST_OFF, "CUDA_VISIBLE_DEVICES": "0,1"})))
    assert on_two["GPUs for parallelism"].status is Status.PASS
    assert on_two["GPUs usable (cgroup)"].measured == "GPU 0, 1 open"
    assert on_two["GPU peer links"].measured == "0-1: NVLink"
    assert on_two["NCCL environment"].status is Status.PASS
    assert on_two["other GPU processes"].measured.startswith("GPU 1: pid 4242")
    # The engine pointed at GPUs 2 and 3: NVML lists them, the cgroup refuses them, and they share no peer access.
    elsewhere = by_name(run_checks(replace(base, engine_env={"CUDA_VISIBLE_DEVICES": "2,3", "NCCL_NVLS_ENABLE": "1"})))
    assert elsewhere["GPUs usable (cgroup)"].blocks_start
    assert elsewhere["NCCL environment"].status is Status.FAIL
    alone = by_name(run_checks(replace(base, engine_env={"CUDA_VISIBLE_DEVICES": "3"})))
    assert alone["GPUs for parallelism"].blocks_start
    cpu = by_name(run_checks(replace(base, cpu=True)))
    assert cpu["GPUs for parallelism"].measured == "skipped: CPU profile"


def test_process_names_come_from_proc() -> None:
    assert multigpu.process_name(os.getpid()) != "?"
    assert multigpu.process_name(2**22 + 1) == "?"
