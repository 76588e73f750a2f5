"""What this machine's NVIDIA GPUs report, through NVML (nvidia-ml-py) with sysfs for the PCIe link.

A typed wrapper: the untyped `pynvml` stays inside this module. No lspci (GPU machines may lack it) and no
nvidia-smi parsing. Imports nothing of ours.
"""

from __future__ import annotations

import enum
import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

try:
    import pynvml  # type: ignore[import-untyped]  # nvidia-ml-py ships no type information
except ImportError:  # the `gpu` extra is not installed
    pynvml = None

_SYSFS_PCI = Path("/sys/bus/pci/devices")
_GT_PER_GEN = {"2.5": 1, "5.0": 2, "8.0": 3, "16.0": 4, "32.0": 5, "64.0": 6}


@dataclass(frozen=True)
class PcieLink:
    gen: int | None
    width: int | None
    max_gen: int | None
    max_width: int | None


@dataclass(frozen=True)
class GpuProcess:
    """A process with a CUDA context on the GPU; `used` None where the driver does not say (some virtual GPUs)."""

    pid: int
    used: int | None


@dataclass(frozen=True)
class GpuDevice:
    index: int
    name: str
    uuid: str
    memory_free: int
    memory_total: int
    compute_capability: tuple[int, int]
    pcie: PcieLink
    processes: tuple[GpuProcess, ...] = ()
    minor: int | None = None  # N of /dev/nvidiaN, the node a process opens to use this GPU


class Topology(enum.IntEnum):
    """How two GPUs are connected, nearest first (NVML's nvmlGpuTopologyLevel_t values)."""

    INTERNAL = 0  # one board (a dual-GPU card)
    SINGLE = 10  # one PCIe switch
    MULTIPLE = 20  # several PCIe switches, no host bridge
    HOSTBRIDGE = 30  # one host bridge
    NODE = 40  # host bridges of one NUMA node
    SYSTEM = 50  # across NUMA nodes (the CPUs' interconnect)


@dataclass(frozen=True)
class GpuLink:
    """Two GPUs (NVML indices) and what joins them: NVLink, peer-to-peer reads over PCIe, the PCIe path."""

    first: int
    second: int
    nvlink: bool
    peer_access: bool  # CUDA peer-to-peer reads work (over NVLink or PCIe)
    topology: Topology | None  # None: NVML did not say


@dataclass(frozen=True)
class GpuReadings:
    driver_version: str | None = None
    cuda_driver: tuple[int, int] | None = None  # the newest CUDA the driver supports
    devices: tuple[GpuDevice, ...] = ()
    error: str | None = None  # NVML unusable although the machine has NVIDIA device nodes
    links: tuple[GpuLink, ...] = ()  # every pair of devices, (0, 1), (0, 2), ... (1, 2), ...

    def link(self, first: int, second: int) -> GpuLink | None:
        """The link between the GPUs with these NVML indices, in either order."""
        low, high = sorted((first, second))
        return next((k for k in self.links if (k.first, k.second) == (low, high)), None)


class _Numbered(Protocol):
    @property
    def index(self) -> int: ...
    @property
    def uuid(self) -> str: ...


_Gpu = TypeVar("_Gpu", bound=_Numbered)


def visible(gpus: Sequence[_Gpu], value: str | None) -> list[_Gpu]:
    """The GPUs a CUDA_VISIBLE_DEVICES value names, in its order (NVML itself ignores the variable); all of them
    when it is unset or names none. Indices are NVML's, which CUDA shares under CUDA_DEVICE_ORDER=PCI_BUS_ID (the
    supervisor sets it); a UUID may be given by a unique prefix. CUDA stops at the first entry that names no GPU."""
    if value is None:
        return list(gpus)
    chosen: list[_Gpu] = []
    for token in (t.strip() for t in value.split(",")):
        match = [g for g in gpus if token and ((token.isdigit() and g.index == int(token)) or g.uuid.startswith(token))]
        if len(match) != 1:
            break
        chosen.append(match[0])
    return chosen or list(gpus)


def device_nodes(dev: Path = Path("/dev")) -> dict[str, bool]:
    """Each /dev/nvidia* character device → whether this process may read and write it."""
    try:
        paths = sorted(dev.glob("nvidia*"))
    except OSError:
        return {}
    return {str(p): os.access(p, os.R_OK | os.W_OK) for p in paths if not p.is_dir()}


def open_error(path: Path) -> str | None:
    """None when this process can open the device node for reading and writing, else why not.

    Opened, not `os.access`ed: a devices cgroup (a container's GPU isolation) refuses the open with EPERM while
    the mode bits, which os.access reads, allow it. No GPU context is made: opening the node only reaches the driver.
    """
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    os.close(fd)
    return None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _optional_int(getter: Any, handle: Any) -> int | None:
    try:
        return int(getter(handle))
    except pynvml.NVMLError:
        return None


def _sysfs_link(bus_id: str) -> PcieLink:
    """The link as the kernel reports it (`0000:18:00.0/current_link_speed` = '32.0 GT/s PCIe')."""
    domain, _, rest = bus_id.lower().partition(":")
    device = _SYSFS_PCI / f"{domain[-4:]}:{rest}"

    def read(name: str) -> str | None:
        try:
            return (device / name).read_text().strip()
        except OSError:
            return None

    def gen(name: str) -> int | None:
        speed = read(name)
        return _GT_PER_GEN.get(speed.split()[0]) if speed else None

    def width(name: str) -> int | None:
        value = read(name)
        return int(value) if value and value.isdigit() else None

    return PcieLink(
        gen("current_link_speed"), width("current_link_width"), gen("max_link_speed"), width("max_link_width")
    )


def _pcie(handle: Any) -> PcieLink:
    link = PcieLink(
        _optional_int(pynvml.nvmlDeviceGetCurrPcieLinkGeneration, handle),
        _optional_int(pynvml.nvmlDeviceGetCurrPcieLinkWidth, handle),
        _optional_int(pynvml.nvmlDeviceGetMaxPcieLinkGeneration, handle),
        _optional_int(pynvml.nvmlDeviceGetMaxPcieLinkWidth, handle),
    )
    if link.gen is not None and link.width is not None:
        return link
    try:
        return _sysfs_link(_text(pynvml.nvmlDeviceGetPciInfo(handle).busId))
    except pynvml.NVMLError:
        return link


def _processes(handle: Any) -> tuple[GpuProcess, ...]:
    """The compute processes on the GPU. Their pids are the host's: inside a container with its own pid
    namespace they match nothing here, so nothing is taken for ours."""
    try:
        found = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
    except pynvml.NVMLError:
        return ()
    processes = []
    for entry in found:
        used = getattr(entry, "usedGpuMemory", None)
        processes.append(GpuProcess(int(entry.pid), int(used) if isinstance(used, int) else None))
    return tuple(processes)


def _device(index: int) -> GpuDevice:
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
    major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
    return GpuDevice(
        index=index,
        name=_text(pynvml.nvmlDeviceGetName(handle)),
        uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
        memory_free=int(memory.free),
        memory_total=int(memory.total),
        compute_capability=(int(major), int(minor)),
        pcie=_pcie(handle),
        processes=_processes(handle),
        minor=_optional_int(pynvml.nvmlDeviceGetMinorNumber, handle),
    )


# nvmlGpuP2PCapsIndex_t: NVML_P2P_CAPS_INDEX_READ is 0 (nvidia-ml-py 13 defines it as the tuple `(0,)`, a stray
# comma, so the literal is used), NVML_P2P_CAPS_INDEX_NVLINK is 2; NVML_P2P_STATUS_OK is 0.
_P2P_READ, _P2P_NVLINK, _P2P_OK = 0, 2, 0


def _p2p(first: Any, second: Any, index: int) -> bool:
    try:
        return int(pynvml.nvmlDeviceGetP2PStatus(first, second, index)) == _P2P_OK
    except pynvml.NVMLError:
        return False


def _link(first: int, second: int) -> GpuLink:
    a, b = pynvml.nvmlDeviceGetHandleByIndex(first), pynvml.nvmlDeviceGetHandleByIndex(second)
    try:
        topology: Topology | None = Topology(int(pynvml.nvmlDeviceGetTopologyCommonAncestor(a, b)))
    except (pynvml.NVMLError, ValueError):
        topology = None
    return GpuLink(first, second, _p2p(a, b, _P2P_NVLINK), _p2p(a, b, _P2P_READ), topology)


def _links(count: int) -> tuple[GpuLink, ...]:
    return tuple(_link(first, second) for first, second in itertools.combinations(range(count), 2))


def read_gpus() -> GpuReadings:
    """Driver, CUDA driver version and every GPU; empty readings on a machine without an NVIDIA driver."""
    has_nodes = Path("/dev/nvidiactl").exists()
    if pynvml is None:
        return GpuReadings(error="nvidia-ml-py is not installed" if has_nodes else None)
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:  # LibraryNotFound / DriverNotLoaded where there is no GPU
        return GpuReadings(error=f"NVML init failed: {exc}" if has_nodes else None)
    try:
        cuda = int(pynvml.nvmlSystemGetCudaDriverVersion())
        count = int(pynvml.nvmlDeviceGetCount())
        return GpuReadings(
            driver_version=_text(pynvml.nvmlSystemGetDriverVersion()),
            cuda_driver=(cuda // 1000, cuda % 1000 // 10),
            devices=tuple(_device(i) for i in range(count)),
            links=_links(count),
        )
    except pynvml.NVMLError as exc:
        return GpuReadings(error=f"NVML: {exc}")
    finally:
        pynvml.nvmlShutdown()


@dataclass(frozen=True)
class GpuActivity:
    """One GPU's load right now, for the metrics; a figure the driver does not give is None."""

    index: int
    name: str
    uuid: str
    utilization: float | None  # fraction of the last sample period a kernel ran, 0..1
    memory_used: int
    memory_total: int
    temperature: float | None  # degrees Celsius
    power: float | None  # watts
    pcie_tx: float | None  # bytes/s, device to host
    pcie_rx: float | None  # bytes/s, host to device


@dataclass(frozen=True)
class _Named:
    index: int
    uuid: str


class ActivityReader:
    """Reads the activity of every GPU, or of those `gpus` names (a CUDA_VISIBLE_DEVICES value: the engine's); NVML
    is initialised on the first read and kept (an init can take a second on a GPU without persistence mode), shut
    down by `close`. No GPU or no NVML: an empty tuple, every time."""

    def __init__(self, gpus: str | None = None) -> None:
        self._ready: bool | None = None  # None: not tried yet; False: no NVML here
        self._gpus = gpus

    def read(self) -> tuple[GpuActivity, ...]:
        """The GPUs' activity now (blocking: a few NVML calls per GPU; call it off the event loop)."""
        if self._ready is None:
            self._ready = _init()
        if not self._ready:
            return ()
        try:
            indices: Sequence[int] = range(int(pynvml.nvmlDeviceGetCount()))
            if self._gpus is not None:
                named = [
                    _Named(i, _text(pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i)))) for i in indices
                ]
                indices = [gpu.index for gpu in visible(named, self._gpus)]
            return tuple(_activity(i) for i in indices)
        except pynvml.NVMLError:
            return ()

    def close(self) -> None:
        """Release NVML (when it was initialised)."""
        if self._ready:
            pynvml.nvmlShutdown()
        self._ready = None


def _init() -> bool:
    if pynvml is None:
        return False
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    return True


def _optional_float(read: Any, scale: float = 1.0) -> float | None:
    try:
        return float(read()) * scale
    except pynvml.NVMLError:
        return None


def _activity(index: int) -> GpuActivity:
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
    utilization = _optional_float(lambda: pynvml.nvmlDeviceGetUtilizationRates(handle).gpu, 0.01)
    return GpuActivity(
        index=index,
        name=_text(pynvml.nvmlDeviceGetName(handle)),
        uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
        utilization=utilization,
        memory_used=int(memory.used),
        memory_total=int(memory.total),
        temperature=_optional_float(lambda: pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)),
        power=_optional_float(lambda: pynvml.nvmlDeviceGetPowerUsage(handle), 0.001),  # NVML says milliwatts
        # KB/s over NVML's last 20 ms window.
        pcie_tx=_optional_float(
            lambda: pynvml.nvmlDeviceGetPcieThroughput(handle, pynvml.NVML_PCIE_UTIL_TX_BYTES), 1024.0
        ),
        pcie_rx=_optional_float(
            lambda: pynvml.nvmlDeviceGetPcieThroughput(handle, pynvml.NVML_PCIE_UTIL_RX_BYTES), 1024.0
        ),
    )
