"""GPU preflight checks: driver vs torch's CUDA, compute capability vs flash-attn, memory, visibility, PCIe.

Each `check_*` takes plain values (tests feed them); the `read_*` functions measure this machine through NVML
(nvidia-ml-py), sysfs and installed files, and never import torch, vllm or flash-attn (that takes seconds).
Imports `check`, `rows`, `fatbin` and `nvml` of ours, and the presets' `GpuNeeds`.
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gateway.doctor import rows
from gateway.doctor.check import NO_GPU, Check, failed, gib, passed, skipped, warned
from gateway.doctor.fatbin import cuda_archs
from gateway.engine.nvml import GpuReadings
from gateway.engine.presets import GpuNeeds

# Lowest driver branch for each CUDA toolkit version (NVIDIA's CUDA release notes, table 3).
_DRIVER_FOR_CUDA = {(11, 8): "520", (12, 0): "525", (12, 4): "550", (12, 6): "560", (12, 8): "570", (13, 0): "580"}
_MEMORY_MARGIN = 2**30  # below this much headroom another process's allocation can stop vLLM's start


@dataclass(frozen=True)
class TorchBuild:
    version: str
    cuda: str | None  # None for a CPU-only build
    location: str


@dataclass(frozen=True)
class FlashAttnBuild:
    source: str  # which installed files were read
    archs: frozenset[str] | None  # None: the libraries were found but their archs could not be read


def _cc_number(arch: str) -> tuple[str, int] | None:
    """'sm_90a' → ('sm', 90); 'compute_80' → ('compute', 80); '9.0' → ('sm', 90); unparsable → None."""
    text = arch.strip().lower().replace("_", "").rstrip("a").rstrip("f")
    kind = "compute" if text.startswith("compute") else "sm"
    digits = text.removeprefix("compute").removeprefix("sm")
    if "." in digits:
        major, _, minor = digits.partition(".")
        digits = f"{major}{minor}"
    return (kind, int(digits)) if digits.isdigit() else None


def check_driver_vs_torch(
    driver_cuda: tuple[int, int] | None, torch_cuda: str | None, driver_version: str = "", torch_version: str = ""
) -> Check:
    """The driver must support the CUDA runtime torch was built for (fatal: vLLM dies at its first CUDA call)."""
    row = rows.DRIVER
    if driver_cuda is None:
        return skipped(row, NO_GPU)
    driver = f"driver {driver_version or '?'} (CUDA {driver_cuda[0]}.{driver_cuda[1]})"
    if torch_cuda is None:
        what = f"torch {torch_version} is a CPU-only build" if torch_version else "torch is not installed"
        return warned(row, f"{driver}; {what}", "install the CUDA build of torch that vLLM pins")
    major, _, minor = torch_cuda.partition(".")
    wanted = (int(major), int(minor or 0))
    measured = f"{driver}; torch {torch_version or '?'} built for CUDA {torch_cuda}"
    branch = _DRIVER_FOR_CUDA.get(wanted) or _DRIVER_FOR_CUDA.get((wanted[0], 0), "?")
    if driver_cuda[0] < wanted[0]:
        fix = (
            f"upgrade the NVIDIA driver to branch {branch}+ (CUDA {torch_cuda}), or install torch/vLLM built for "
            f"CUDA {driver_cuda[0]}.x (e.g. the +cu{driver_cuda[0]}x wheels)"
        )
        return failed(row, measured, fix)
    if driver_cuda < wanted:
        fix = (
            f"runs through CUDA minor-version compatibility, but PTX JIT and newer features need driver {branch}+: "
            "upgrade the driver"
        )
        return warned(row, measured, fix)
    return passed(row, measured)


def check_compute_capability(cc: tuple[int, int], flash_attn_archs: set[str] | frozenset[str] | None) -> Check:
    """The GPU must be one the installed flash-attn has kernels for (sm80 kernels run on 8.x, sm90 on 9.0 only)."""
    row = rows.FLASH_ATTN
    number = cc[0] * 10 + cc[1]
    measured = f"cc {cc[0]}.{cc[1]}"
    if cc < (8, 0):
        fix = "FlashAttention needs compute capability 8.0+ (Ampere): vLLM falls back to a slower backend"
        return failed(row, measured, fix)
    if flash_attn_archs is None:
        return warned(row, f"{measured}; flash-attn archs unknown", "check that the flash-attn build covers sm_XY")
    parsed = [p for p in (_cc_number(a) for a in flash_attn_archs) if p is not None]
    measured = f"{measured}; flash-attn has {', '.join(sorted(flash_attn_archs)) or 'no archs'}"
    if any(kind == "sm" and n // 10 == cc[0] and n % 10 <= cc[1] for kind, n in parsed):
        return passed(row, measured)
    if any(kind == "compute" and n <= number for kind, n in parsed):
        return warned(row, measured, f"only PTX covers sm{number}: slow JIT at first start; install a build for it")
    fix = f"install a flash-attn / vLLM build compiled for sm{number} (TORCH_CUDA_ARCH_LIST={cc[0]}.{cc[1]})"
    return failed(row, measured, fix)


def check_gpu_memory(free: int, total: int, utilization: float, held: int = 0) -> Check:
    """vLLM refuses to start when free memory is below utilization * total (fatal). `held`: what our own running
    engine holds, free again for the engine the doctor checks (a hand-run doctor next to the running stack)."""
    row = rows.GPU_MEMORY
    need = utilization * total
    available = free + held
    ours = f" (+{gib(held)} held by the running engine)" if held else ""
    measured = f"{gib(free)} free of {gib(total)}{ours}; --gpu-memory-utilization {utilization:g} needs {gib(need)}"
    if available < need:
        fits = max(available / total - 0.01, 0.0)
        fix = f"stop the process holding {gib(total - available)}, or lower --gpu-memory-utilization to {fits:.2f}"
        return failed(row, measured, fix)
    if available - need < _MEMORY_MARGIN:
        return warned(row, measured, "under 1 GiB of headroom: another allocation will stop vLLM's start")
    return passed(row, measured)


def _match_uuid(token: str, uuids: Sequence[str]) -> bool:
    if not uuids:
        return True  # UUIDs unknown: accept the form, CUDA will judge
    return sum(u.lower().startswith(token.lower()) for u in uuids) == 1


@dataclass(frozen=True)
class SeenGpu:
    """What the preset check reads of one visible GPU."""

    name: str
    compute_capability: tuple[int, int]
    memory_total: int  # bytes


def check_preset_gpus(preset: str, needs: GpuNeeds, gpus: Sequence[SeenGpu], spread: int = 1) -> Check:
    """The preset's checkpoint needs this many GPUs, this generation and this much memory, and the engine's argv
    must spread it over that many (fatal: vLLM finds out minutes into the start, or never has the kernels)."""
    row = rows.PRESET_GPUS
    wanted = f"preset {preset} needs {needs.describe()}"
    if needs == GpuNeeds():
        return passed(row, f"preset {preset} names no GPU needs")
    seen = ", ".join(f"{g.name} (cc {g.compute_capability[0]}.{g.compute_capability[1]})" for g in gpus)
    measured = f"{wanted}; visible: {len(gpus)} x {seen or 'none'}"
    if needs.compute_capability is not None and any(g.compute_capability < needs.compute_capability for g in gpus):
        major, minor = needs.compute_capability
        fix = (
            f"its weights need compute capability {major}.{minor}+ kernels: serve it on such GPUs, or choose the "
            "preset of a checkpoint these GPUs run (FP8 or BF16 on Hopper)"
        )
        return failed(row, measured, fix)
    if len(gpus) < needs.count:
        fix = f"make {needs.count} GPUs visible (CUDA_VISIBLE_DEVICES), or choose a checkpoint that fits fewer"
        return failed(row, measured, fix)
    used = list(gpus)[: max(spread, 1)]
    if spread < needs.count:
        fix = (
            f"spread the engine over {needs.count} GPUs: --tensor-parallel-size {needs.count} (a multi-GPU "
            "profile, or NEMOTRON_ENGINE__EXTRA_ARGS)"
        )
        return failed(row, f"{measured}; the engine's argv spreads it over {spread}", fix)
    memory = sum(g.memory_total for g in used)
    if needs.memory_gb is not None and memory < needs.memory_gb * 10**9:
        fix = "spread it over more GPUs (--tensor-parallel-size), or choose a smaller checkpoint (FP8, NVFP4)"
        return failed(row, f"{measured}; the {len(used)} GPU(s) it uses hold {memory / 10**9:.0f} GB", fix)
    return passed(row, f"{measured}; spread over {len(used)}")


def check_cuda_visible_devices(value: str | None, gpu_count: int, uuids: Sequence[str] = ()) -> Check:
    """Every entry must name an existing GPU: CUDA stops at the first bad one (fatal when none is left)."""
    row = rows.CUDA_VISIBLE_DEVICES
    if gpu_count == 0:
        return skipped(row, NO_GPU)
    if value is None:
        return passed(row, f"unset: all {gpu_count} GPU(s) visible")
    tokens = [t.strip() for t in value.split(",")] if value.strip() else []
    good: list[str] = []
    bad: str | None = None
    for token in tokens:
        if token.isdigit() and int(token) < gpu_count:
            good.append(token)
        elif token.upper().startswith(("GPU-", "MIG-")) and _match_uuid(token, uuids):
            good.append(token)
        else:
            bad = token
            break
    measured = f"{value!r} with {gpu_count} GPU(s) present (indices 0..{gpu_count - 1})"
    if not good:
        fix = "set CUDA_VISIBLE_DEVICES to existing indices or UUIDs (nvidia-smi -L), e.g. 0, or unset it"
        return failed(row, f"{measured}: names no GPU", fix)
    if bad is not None:
        return warned(row, f"{measured}: CUDA ignores {bad!r} and what follows", "remove the bad entry")
    if len(set(good)) < len(good):
        return warned(row, f"{measured}: a GPU is named twice", "name each GPU once")
    return passed(row, f"{value!r}: {len(good)} of {gpu_count} GPU(s)")


def check_pcie(gen: int | None, width: int | None, max_gen: int | None, max_width: int | None) -> Check:
    """A link below gen4 x16 slows weight loading and host transfers (warn; the `pcie-limited` profile helps)."""
    row = rows.PCIE
    if gen is None or width is None:
        return warned(row, "not readable through NVML or sysfs", "read it with nvidia-smi -q -d PCIE")
    measured = f"gen{gen} x{width} (max gen{max_gen or '?'} x{max_width or '?'})"
    if width < 16 or (max_width is not None and max_width < 16):
        fix = "seat the GPU in an x16 slot / riser; meanwhile use the pcie-limited profile"
        return warned(row, measured, fix)
    if gen < 4 and (max_gen is None or max_gen < 4):
        return warned(row, measured, "the slot tops out below gen4: use a gen4+ slot or the pcie-limited profile")
    if gen < 4:
        return passed(row, f"{measured}; idle links train down, full speed under load")
    return passed(row, measured)


def check_device_nodes(nodes: dict[str, bool], gpu_present: bool) -> Check:
    """/dev/nvidiactl, /dev/nvidia-uvm and /dev/nvidiaN must exist and be read-writable for CUDA."""
    row = rows.DEVICE_NODES
    if not gpu_present:
        return skipped(row, NO_GPU)
    if not nodes:
        return warned(row, "no /dev/nvidia* nodes although NVML sees a GPU", "check the container's device list")
    closed = sorted(path for path, ok in nodes.items() if not ok)
    measured = ", ".join(sorted(nodes))
    if closed:
        fix = (
            "grant access: add the service user to the video group, or allow the devices in the container / "
            "cgroup (cgroup v2 filters devices by eBPF: a `systemctl daemon-reload` can drop a container's rules)"
        )
        return failed(row, f"not read-writable: {', '.join(closed)}", fix)
    if "/dev/nvidia-uvm" not in nodes:
        return warned(row, f"{measured}; /dev/nvidia-uvm missing", "load it: nvidia-modprobe -u -c=0")
    return passed(row, measured)


def read_torch_build() -> TorchBuild | None:
    """torch's version and CUDA from its `version.py`, without importing torch (None if not installed)."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    package = Path(next(iter(spec.submodule_search_locations)))
    try:
        tree = ast.parse((package / "version.py").read_text())
    except (OSError, SyntaxError):
        return TorchBuild("?", None, str(package))
    values: dict[str, object] = {}
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        value = getattr(node, "value", None)
        if isinstance(target, ast.Name) and isinstance(value, ast.Constant):
            values[target.id] = value.value
    cuda = values.get("cuda")
    return TorchBuild(str(values.get("__version__", "?")), cuda if isinstance(cuda, str) else None, str(package))


def _package_dir(name: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(spec.origin).parent if spec.origin else None


def flash_attn_libraries() -> list[Path]:
    """The compiled flash-attention kernels installed: vLLM's vendored copy, flash-attn 2 and 3."""
    found: list[Path] = []
    vllm = _package_dir("vllm")
    if vllm is not None:
        found += sorted((vllm / "vllm_flash_attn").glob("*.so"))
    for module in ("flash_attn_2_cuda", "flash_attn_3"):
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            continue
        if spec is not None and spec.submodule_search_locations:
            found += sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.so"))
        elif spec is not None and spec.origin and spec.origin.endswith(".so"):
            found.append(Path(spec.origin))
    return found


def read_flash_attn_build(libraries: Sequence[Path]) -> FlashAttnBuild | None:
    """The union of the archs in `libraries` (None if there are none)."""
    if not libraries:
        return None
    archs: set[str] = set()
    for library in libraries:
        archs |= cuda_archs(library) or set()
    source = ", ".join(p.name for p in libraries)
    return FlashAttnBuild(source, frozenset(archs) if archs else None)


def check_gpu_present(readings: GpuReadings, cpu_profile: bool) -> Check:
    """A GPU profile needs an NVIDIA GPU NVML can see (fatal); the CPU profile needs none."""
    row = rows.GPU_PRESENT
    if readings.devices:
        models = ", ".join(dict.fromkeys(d.name for d in readings.devices))
        measured = f"{len(readings.devices)} x {models}; driver {readings.driver_version}"
        return passed(row, measured + ("; CPU profile: GPUs unused" if cpu_profile else ""))
    if cpu_profile:
        return skipped(row, NO_GPU if readings.error is None else f"CPU profile ({readings.error})")
    if readings.error is not None:
        fix = "check `nvidia-smi`, the driver install, and this process's access to /dev/nvidia*"
        return failed(row, readings.error, fix)
    fix = "install the NVIDIA driver (and nvidia-ml-py), or run the CPU profile"
    return failed(row, "no NVIDIA GPU or driver found", fix)


def check_flash_attn(cc: tuple[int, int], build: FlashAttnBuild | None) -> Check:
    """`check_compute_capability` against the installed kernels, or a warning that none are installed."""
    if build is None:
        fix = "install vLLM's CUDA build (it vendors flash-attn) in the Python the supervisor runs"
        return warned(rows.FLASH_ATTN, f"cc {cc[0]}.{cc[1]}; no flash-attn kernels here", fix)
    return check_compute_capability(cc, build.archs)
