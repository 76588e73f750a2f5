"""Preflight checks of an engine on several GPUs: enough GPUs for its parallelism, GPUs the cgroup lets it use,
the links between them, NCCL's environment, and other processes on its GPUs.

Each `check_*` takes plain values (tests feed them recorded NVML answers); the runner reads this machine. The
GPUs are NVML's indices, which ignore CUDA_VISIBLE_DEVICES; the runner passes the ones the engine will use.
Imports `check`, `rows` and `nvml` of ours, and the supervisor's multicast defaults.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from gateway.doctor import rows
from gateway.doctor.check import Check, failed, gib, passed, skipped, warned
from gateway.engine.launch import MULTICAST_OFF
from gateway.engine.nvml import GpuDevice, GpuLink, GpuReadings, Topology

_TRUE = frozenset(("1", "true", "yes", "on"))
_SYS_NET = Path("/sys/class/net")
_GPUS_FIX = "name the GPUs with NEMOTRON_ENGINE__GPUS (a CUDA_VISIBLE_DEVICES value, e.g. 0,1)"


@dataclass(frozen=True)
class Parallelism:
    """The engine's parallel sizes from its argv (vLLM's defaults: 1 each)."""

    tensor: int = 1
    pipeline: int = 1
    data: int = 1
    data_local: int | None = None  # --data-parallel-size-local: the data-parallel ranks on this host

    @property
    def gpus(self) -> int:
        """The GPUs this host's part of the engine needs: tensor x pipeline x the local data-parallel ranks."""
        return self.tensor * self.pipeline * (self.data if self.data_local is None else self.data_local)

    def describe(self) -> str:
        parts = [f"tensor {self.tensor}", f"pipeline {self.pipeline}", f"data {self.data}"]
        if self.data_local is not None:
            parts.append(f"data on this host {self.data_local}")
        return " x ".join(parts)


def _labels(devices: Sequence[GpuDevice]) -> str:
    return ", ".join(str(d.index) for d in devices) or "none"


def check_parallel_gpus(parallel: Parallelism, engine_gpus: Sequence[GpuDevice], gpu_count: int) -> Check:
    """vLLM needs one GPU per rank on this host (fatal: it fails after loading for minutes otherwise)."""
    row = rows.GPU_COUNT
    if gpu_count == 0:
        return skipped(row, "skipped: no NVIDIA GPU")
    measured = f"{parallel.describe()} needs {parallel.gpus} GPU(s); the engine sees {len(engine_gpus)}"
    measured += f" (GPU {_labels(engine_gpus)})"
    if parallel.gpus > len(engine_gpus):
        if parallel.gpus <= gpu_count:
            fix = f"give the engine {parallel.gpus} GPUs: {_GPUS_FIX}, or unset it to use all {gpu_count}"
        else:
            fix = (
                f"this host has {gpu_count} GPU(s): lower --tensor-parallel-size / --data-parallel-size to fit, "
                "or use a host with more GPUs"
            )
        return failed(row, measured, fix)
    if parallel.gpus < len(engine_gpus):
        fix = f"the engine uses the first {parallel.gpus}; {_GPUS_FIX} to leave the others free for something else"
        return passed(row, measured, fix)
    return passed(row, measured)


def node_of(device: GpuDevice, dev: Path = Path("/dev")) -> Path | None:
    """The /dev/nvidiaN node of the GPU (None when NVML did not give its minor number)."""
    return None if device.minor is None else dev / f"nvidia{device.minor}"


def check_gpu_access(engine_gpus: Sequence[GpuDevice], errors: Mapping[int, str | None]) -> Check:
    """Each of the engine's GPUs must be one this process may open (fatal). NVML may list GPUs a container's devices
    cgroup does not allow: CUDA then fails on them, or counts fewer GPUs than the engine asks for.

    `errors`: NVML index -> why its /dev/nvidiaN does not open (None: it opens; missing: minor unknown)."""
    row = rows.GPU_ACCESS
    if not engine_gpus:
        return skipped(row, "skipped: no NVIDIA GPU")
    refused = {d.index: errors[d.index] for d in engine_gpus if errors.get(d.index) is not None}
    unknown = [d.index for d in engine_gpus if d.index not in errors]
    usable = [d.index for d in engine_gpus if d.index in errors and errors[d.index] is None]
    measured = f"GPU {', '.join(map(str, usable)) or 'none'} open"
    if refused:
        shown = "; ".join(f"GPU {index}: {why}" for index, why in refused.items())
        fix = (
            "NVML lists GPUs this process may not use (a container's devices cgroup): "
            f"{_GPUS_FIX} to the ones that open, or give the container those devices (docker --gpus, the Kubernetes "
            "device plugin; on cgroup v2 a `systemctl daemon-reload` can drop a container's device rules)"
        )
        return failed(row, f"{measured}; refused: {shown}", fix)
    if unknown:
        return warned(
            row, f"{measured}; GPU {', '.join(map(str, unknown))}: no minor number from NVML", "check with nvidia-smi"
        )
    return passed(row, measured)


def _link_text(link: GpuLink) -> str:
    if link.nvlink:
        return "NVLink"
    if link.peer_access:
        return f"PCIe peer-to-peer ({_topology(link.topology)})"
    return f"no peer access ({_topology(link.topology)})"


def _topology(level: Topology | None) -> str:
    names = {
        Topology.INTERNAL: "one board",
        Topology.SINGLE: "one PCIe switch",
        Topology.MULTIPLE: "several PCIe switches",
        Topology.HOSTBRIDGE: "one host bridge",
        Topology.NODE: "one NUMA node",
        Topology.SYSTEM: "across NUMA nodes",
    }
    return "path unknown" if level is None else names[level]


def check_peer_links(parallel: Parallelism, engine_gpus: Sequence[GpuDevice], readings: GpuReadings) -> Check:
    """Tensor (and pipeline) parallel ranks all-reduce on every token: over NVLink that is cheap, over PCIe slower,
    and without peer access it goes through host memory (warn). Data-parallel ranks exchange nearly nothing."""
    row = rows.PEER_LINKS
    if len(engine_gpus) < 2:
        return skipped(row, "skipped: the engine uses one GPU")
    group = engine_gpus[: parallel.tensor * parallel.pipeline]
    if len(group) < 2:
        return passed(row, f"tensor parallel 1: the {len(engine_gpus)} data-parallel ranks share nothing per token")
    pairs = [(a, b, readings.link(a.index, b.index)) for a, b in itertools.combinations(group, 2)]
    measured = "; ".join(f"{a.index}-{b.index}: {_link_text(k) if k else 'not read'}" for a, b, k in pairs)
    if any(k is None for _, _, k in pairs):
        return warned(row, measured, "read the links with `nvidia-smi topo -m`")
    links = [k for _, _, k in pairs if k is not None]
    if all(k.nvlink for k in links):
        return passed(row, measured)
    if any(not k.peer_access for k in links):
        fix = (
            "the all-reduce of tensor parallel goes through host memory between these GPUs: choose GPUs joined by "
            "NVLink or one PCIe switch (`nvidia-smi topo -m`), or run data parallel (--data-parallel-size) instead"
        )
        return warned(row, measured, fix)
    fix = "tensor parallel over PCIe is slower than over NVLink; data parallel (--data-parallel-size) may serve more"
    return passed(row, measured, fix)


def network_interfaces(root: Path = _SYS_NET) -> set[str]:
    """The names of this host's network interfaces."""
    try:
        return {entry.name for entry in root.iterdir()}
    except OSError:
        return set()


def _interface_problem(value: str, interfaces: set[str]) -> str | None:
    """NCCL_SOCKET_IFNAME's rule (a prefix list; `=` exact, `^` exclude): None when it selects an interface."""
    exclude = value.startswith("^")
    body = value.removeprefix("^")
    exact = body.startswith("=")
    names = [n.strip() for n in body.removeprefix("=").split(",") if n.strip()]

    def matches(interface: str) -> bool:
        return any(interface == n if exact else interface.startswith(n) for n in names)

    if not interfaces or any(matches(i) != exclude for i in interfaces):
        return None
    return f"NCCL_SOCKET_IFNAME={value} matches none of {', '.join(sorted(interfaces))}"


def check_nccl_environment(env: Mapping[str, str], gpus: int, interfaces: set[str]) -> Check:
    """NCCL variables that break or slow an engine on several GPUs, in the engine's environment. NVLink multicast
    on fails the row: the supervisor turns it off unless the operator turns it on."""
    row = rows.NCCL_ENV
    if gpus < 2:
        return skipped(row, "skipped: the engine uses one GPU (no NCCL)")
    failures: list[tuple[str, str]] = []
    warnings: list[tuple[str, str]] = []
    multicast = {k: env[k] for k in MULTICAST_OFF if k in env and env[k] != MULTICAST_OFF[k]}
    if multicast:
        shown = ", ".join(f"{k}={v}" for k, v in multicast.items())
        failures.append(
            (
                f"NVLink multicast on ({shown})",
                f"set {', '.join(f'{k}={MULTICAST_OFF[k]}' for k in multicast)}: "
                "a multicast fault can leave the host's GPUs unusable until it is reset",
            )
        )
    p2p_off = env.get("NCCL_P2P_DISABLE", "").lower() in _TRUE
    shm_off = env.get("NCCL_SHM_DISABLE", "").lower() in _TRUE
    if p2p_off and shm_off:
        failures.append(("NCCL_P2P_DISABLE and NCCL_SHM_DISABLE: only sockets are left between the GPUs", "unset both"))
    elif p2p_off:
        warnings.append(("NCCL_P2P_DISABLE=1: the all-reduce goes through host memory", "unset NCCL_P2P_DISABLE"))
    if (value := env.get("NCCL_SOCKET_IFNAME")) and (problem := _interface_problem(value, interfaces)):
        failures.append(
            (f"{problem}: NCCL's bootstrap finds no interface", "unset NCCL_SOCKET_IFNAME or name one of them")
        )
    forced = [f"{k}={env[k]}" for k in ("NCCL_ALGO", "NCCL_PROTO") if env.get(k)]
    if forced:
        warnings.append(
            (f"{', '.join(forced)} forces NCCL's choice", "unset it unless NCCL's own choice was measured worse")
        )
    if env.get("CUDA_LAUNCH_BLOCKING", "").lower() in _TRUE:
        warnings.append(("CUDA_LAUNCH_BLOCKING=1 serialises every kernel", "unset CUDA_LAUNCH_BLOCKING"))
    shown_multicast = ", ".join(f"{k}={env.get(k, 'unset')}" for k in MULTICAST_OFF)
    if failures or warnings:
        found = failures or warnings
        measured = "; ".join(what for what, _ in [*failures, *warnings])
        fix = "; ".join(how for _, how in found)
        return failed(row, measured, fix) if failures else warned(row, measured, fix)
    return passed(row, f"no NCCL variable that breaks tensor parallel; {shown_multicast}")


def process_name(pid: int, proc: Path = Path("/proc")) -> str:
    """A process's command name, or '?' where its /proc entry is not visible (another pid namespace)."""
    try:
        return (proc / str(pid) / "comm").read_text().strip() or "?"
    except OSError:
        return "?"


def check_other_processes(engine_gpus: Sequence[GpuDevice], ours: frozenset[int], names: Mapping[int, str]) -> Check:
    """Processes other than our engine with memory on the engine's GPUs (warn): they shrink its KV cache, or stop
    its start. `ours`: the running engine's processes (a hand-run doctor); `names`: pid -> command name."""
    row = rows.GPU_PROCESSES
    if not engine_gpus:
        return skipped(row, "skipped: no NVIDIA GPU")
    found = [(d.index, p) for d in engine_gpus for p in d.processes if p.pid not in ours]
    if not found:
        return passed(row, f"none on GPU {_labels(engine_gpus)}")
    shown = "; ".join(
        f"GPU {index}: pid {p.pid} ({names.get(p.pid, '?')}) {gib(p.used) if p.used is not None else 'size unknown'}"
        for index, p in found
    )
    fix = f"stop them (`nvidia-smi --query-compute-apps=pid,used_memory --format=csv`), or {_GPUS_FIX} to other GPUs"
    return warned(row, shown, fix)
