"""The managed replicas of one host: which ones this process runs, the GPUs each gets, each one's own settings.

Every replica is a `vllm serve` of the same model on its own port (`engine.replica_port(i)`), with its own GPUs and
state dir (`engine.replica_state_dir(i)`: status file, run.env, restart request). The GPUs are split in order into
groups of the engine's tensor x pipeline x data parallel size, the first group for replica 0: the same split in every
process, so one systemd instance per replica (`engine.replica`) finds the same GPUs the all-in-one supervisor would
give it. Imports settings, the engine's status record and NVML.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence

from gateway.engine.nvml import read_gpus
from gateway.engine.profiles import ProfileError
from gateway.engine.supervisor_state import DATA_PARALLEL_FLAG, TENSOR_PARALLEL_FLAG, flag_value, parallel_size
from gateway.settings import EngineSettings, Settings

PIPELINE_PARALLEL_FLAG = "--pipeline-parallel-size"
GPU_MEMORY_FLAG = "--gpu-memory-utilization"


def replica_indices(engine: EngineSettings) -> list[int]:
    """The replicas this process runs: only `engine.replica` when set, else every one of `engine.replicas`."""
    return [engine.replica] if engine.replica is not None else list(range(engine.replicas))


def gpus_per_replica(argv: Sequence[str]) -> int:
    """The GPUs one engine launched with `argv` uses: tensor x pipeline x data parallel size."""
    flags = list(argv)
    return (
        parallel_size(flags, TENSOR_PARALLEL_FLAG)
        * parallel_size(flags, PIPELINE_PARALLEL_FLAG)
        * parallel_size(flags, DATA_PARALLEL_FLAG)
    )


def nvml_gpu_indices() -> list[str]:
    """This machine's GPUs by NVML index (PCI bus order), as CUDA_VISIBLE_DEVICES names them; none without NVML."""
    return [str(device.index) for device in read_gpus().devices]


def available_gpus(
    engine: EngineSettings,
    environ: Mapping[str, str] | None = None,
    machine_gpus: Callable[[], list[str]] = nvml_gpu_indices,
) -> list[str]:
    """The GPUs the replicas share, in order: `engine.gpus`, else an inherited CUDA_VISIBLE_DEVICES, else every GPU
    NVML sees. Empty on a machine without GPUs."""
    environ = os.environ if environ is None else environ
    given = engine.gpus if engine.gpus is not None else environ.get("CUDA_VISIBLE_DEVICES")
    if given is not None:
        return [token.strip() for token in given.split(",") if token.strip()]
    return machine_gpus()


def split_gpus(gpus: Sequence[str], per_replica: int, replicas: int) -> list[str]:
    """`replicas` CUDA_VISIBLE_DEVICES values of `per_replica` GPUs each, taken from `gpus` in order; a ProfileError
    naming what is missing when there are too few. GPUs left over stay unused."""
    needed = per_replica * replicas
    if len(gpus) < needed:
        seen = ",".join(gpus) or "none"
        raise ProfileError(
            f"{replicas} engine replicas of {per_replica} GPU(s) each (tensor x pipeline x data parallel size) need "
            f"{needed} GPUs; {len(gpus)} available (GPUs: {seen}): lower NEMOTRON_ENGINE__REPLICAS or the parallel "
            "sizes, or name more GPUs in NEMOTRON_ENGINE__GPUS"
        )
    return [",".join(gpus[i * per_replica : (i + 1) * per_replica]) for i in range(replicas)]


def runs_on_gpus(argv: Sequence[str]) -> bool:
    """Whether an engine launched with `argv` uses GPUs: every GPU profile sets vLLM's GPU memory share, the CPU
    profile none (the doctor's rule too)."""
    return flag_value(list(argv), GPU_MEMORY_FLAG) is not None


def replica_gpus(
    engine: EngineSettings,
    argv: Sequence[str],
    environ: Mapping[str, str] | None = None,
    machine_gpus: Callable[[], list[str]] = nvml_gpu_indices,
) -> list[str | None]:
    """Each replica's CUDA_VISIBLE_DEVICES value (index i for replica i), its share of `available_gpus`; for one
    replica, or an engine on the CPU, `engine.gpus` (what a single engine always had: None keeps the inherited one).
    A ProfileError when the GPUs are too few for every replica."""
    if engine.replicas == 1 or not runs_on_gpus(argv):
        return [engine.gpus] * engine.replicas
    return list(split_gpus(available_gpus(engine, environ, machine_gpus), gpus_per_replica(argv), engine.replicas))


def replica_settings(settings: Settings, index: int, gpus: str | None) -> Settings:
    """The settings of replica `index` alone: its port, its state dir and its GPUs, everything else shared."""
    engine = settings.engine
    mine = engine.model_copy(
        update={"port": engine.replica_port(index), "state_dir": engine.replica_state_dir(index), "gpus": gpus}
    )
    return settings.model_copy(update={"engine": mine})
