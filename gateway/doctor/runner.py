"""Runs every preflight check on this machine for one engine configuration (`DoctorConfig`).

The supervisor calls `run_checks` before it spawns the engine; `doctor_config` says what the engine would be
started with (the flags of the argv the supervisor builds). Imports settings, the engine package's profiles and
launcher, and the doctor's own modules; never the HTTP app.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from gateway.doctor import rows
from gateway.doctor.check import NO_GPU, Check, skipped, worst
from gateway.doctor.engine_config import (
    NOT_INSTALLED,
    VERDICT_LATER,
    EngineVerdict,
    ask_vllm,
    check_vllm_version,
    engine_checks,
    installed_version,
)
from gateway.doctor.flags import engine_flags
from gateway.doctor.gpu import (
    SeenGpu,
    check_cuda_visible_devices,
    check_device_nodes,
    check_driver_vs_torch,
    check_flash_attn,
    check_gpu_memory,
    check_gpu_present,
    check_pcie,
    check_preset_gpus,
    flash_attn_libraries,
    read_flash_attn_build,
    read_torch_build,
)
from gateway.doctor.host import (
    MIN_CACHE_DISK,
    check_cgroup,
    check_disk,
    check_engine_port,
    check_proxy,
    check_redis,
    check_ulimit,
    probe_port,
    probe_proxies,
    probe_redis,
    proxy_settings,
    read_cgroup,
    read_free_disk,
    read_open_files,
)
from gateway.doctor.model import ModelFlags, check_model_dir, resolve_model
from gateway.doctor.multigpu import (
    Parallelism,
    check_gpu_access,
    check_nccl_environment,
    check_other_processes,
    check_parallel_gpus,
    check_peer_links,
    network_interfaces,
    node_of,
    process_name,
)
from gateway.doctor.running import RunningEngine, running_engine
from gateway.engine.launch import added_variables, engine_environment, engine_python
from gateway.engine.nvml import GpuDevice, GpuReadings, device_nodes, open_error, read_gpus, visible
from gateway.engine.presets import GpuNeeds, load_presets, select_preset
from gateway.engine.profiles import Profile, build_argv
from gateway.settings import Settings, masked_redis_url


@dataclass(frozen=True)
class DoctorConfig:
    """What the engine is about to be started with; `doctor_config` fills it from the engine's argv."""

    model: str | None = None  # a local directory or a hub id (org/name)
    tokenizer: str | None = None  # --tokenizer, where it differs from the model (AWQ profile)
    chat_template: str | Path | None = None  # --chat-template: a file, or the template itself
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.90
    load_format: str | None = None  # --load-format; `dummy` reads no weights
    quantization: str | None = None  # --quantization: the checkpoint must be of that scheme
    hf_overrides: Mapping[str, Any] = field(default_factory=dict)  # --hf-overrides, applied to config.json
    hf_overrides_error: str | None = None
    reasoning_parser: str | None = None  # --reasoning-parser; a reasoning model fails without one
    engine_host: str = "127.0.0.1"
    engine_port: int = 8001
    engine_status_file: Path | None = None  # the supervisor's status: our running engine's port and GPU memory
    redis_url: str | None = None  # None: the Redis row is skipped
    redis_sentinel_password: SecretStr | None = None  # the Sentinels' own, with a redis+sentinel:// URL
    cache_dir: Path | None = None  # None: HF_HUB_CACHE / HF_HOME / ~/.cache/huggingface (--download-dir sets it)
    model_size_bytes: int | None = None  # raises the free-disk floor above 15 GB when known
    cpu: bool = False  # the CPU profile: no GPU is needed
    environ: Mapping[str, str] | None = None  # None: this process's environment
    # The engine's interpreter, its argv without the launcher, and the variables its profile adds: the context
    # length and model config are then vLLM's own verdict. None: not asked (the gateway's own rules).
    engine_python: str | None = None
    # False: run every check but vLLM's verdict (a second or two), and ask it with `vllm_verdict_checks` later:
    # the supervisor asks beside the engine's start, as both import vLLM.
    ask_vllm: bool = True
    engine_args: tuple[str, ...] = ()
    engine_env: Mapping[str, str] = field(default_factory=dict)
    verdict_cache: Path | None = None  # where vLLM's verdicts are kept (the state dir); None: not kept
    parallel: Parallelism = field(
        default_factory=Parallelism
    )  # --tensor-parallel-size, --data-parallel-size, ... of the argv
    # The model preset: what its checkpoint needs of the GPUs and of the installed vLLM, and how many GPUs the
    # engine's argv spreads it over (--tensor-parallel-size x --pipeline-parallel-size).
    preset: str = "generic"
    preset_needs: GpuNeeds = field(default_factory=GpuNeeds)
    min_vllm: str | None = None
    gpu_spread: int = 1


def hub_cache(env: Mapping[str, str]) -> Path:
    """Where huggingface_hub keeps downloads, by its own rules."""
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    base = Path(env["XDG_CACHE_HOME"]).expanduser() if env.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return base / "huggingface" / "hub"


def _gpu_checks(
    config: DoctorConfig, readings: GpuReadings, env: Mapping[str, str], engine: RunningEngine | None
) -> list[Check]:
    present = check_gpu_present(readings, config.cpu)
    nodes = check_device_nodes(device_nodes(), bool(readings.devices))
    if not readings.devices or config.cpu:
        why = "skipped: CPU profile" if readings.devices else NO_GPU
        given = {rows.GPU_PRESENT.name: present, rows.DEVICE_NODES.name: nodes}
        return [given.get(row.name) or skipped(row, why) for row in rows.GPU_ROWS]
    torch = read_torch_build()
    flash = read_flash_attn_build(flash_attn_libraries())
    # The engine's own environment decides which GPUs it sees (NEMOTRON_ENGINE__GPUS reaches it there).
    engine_env = {**env, **config.engine_env}
    engine_gpus = visible(readings.devices, engine_env.get("CUDA_VISIBLE_DEVICES"))
    labels = [f"GPU {d.index}" for d in engine_gpus]
    driver = check_driver_vs_torch(
        readings.cuda_driver,
        torch.cuda if torch else None,
        readings.driver_version or "",
        torch.version if torch else "",
    )
    return [
        present,
        driver,
        worst(rows.FLASH_ATTN, [check_flash_attn(d.compute_capability, flash) for d in engine_gpus], labels),
        worst(
            rows.GPU_MEMORY,
            [
                check_gpu_memory(d.memory_free, d.memory_total, config.gpu_memory_utilization, _held(d, engine))
                for d in engine_gpus
            ],
            labels,
        ),
        check_preset_gpus(
            config.preset,
            config.preset_needs,
            [SeenGpu(d.name, d.compute_capability, d.memory_total) for d in engine_gpus],
            config.gpu_spread,
        ),
        check_cuda_visible_devices(
            engine_env.get("CUDA_VISIBLE_DEVICES"), len(readings.devices), [d.uuid for d in readings.devices]
        ),
        worst(
            rows.PCIE,
            [check_pcie(d.pcie.gen, d.pcie.width, d.pcie.max_gen, d.pcie.max_width) for d in engine_gpus],
            labels,
        ),
        nodes,
        *_multi_gpu_checks(config, readings, engine_gpus, engine_env, engine),
    ]


def _multi_gpu_checks(
    config: DoctorConfig,
    readings: GpuReadings,
    engine_gpus: Sequence[GpuDevice],
    engine_env: Mapping[str, str],
    engine: RunningEngine | None,
) -> list[Check]:
    """The rows of an engine on several GPUs, for the GPUs it will use (the first `parallel.gpus` it sees)."""
    used = list(engine_gpus[: max(config.parallel.gpus, 1)])
    nodes = {d.index: node_of(d) for d in used}
    errors = {index: open_error(node) for index, node in nodes.items() if node is not None}
    ours = engine.pids if engine is not None else frozenset()
    others = {p.pid for d in used for p in d.processes if p.pid not in ours}
    return [
        check_parallel_gpus(config.parallel, engine_gpus, len(readings.devices)),
        check_gpu_access(used, errors),
        check_peer_links(config.parallel, used, readings),
        check_nccl_environment(engine_env, len(used), network_interfaces()),
        check_other_processes(used, ours, {pid: process_name(pid) for pid in others}),
    ]


def _host_checks(config: DoctorConfig, env: Mapping[str, str], engine: RunningEngine | None) -> list[Check]:
    soft, hard = read_open_files()
    disk_at, free = read_free_disk(config.cache_dir or hub_cache(env))
    proxies = proxy_settings(env)
    if config.redis_url:
        probed = probe_redis(config.redis_url, sentinel_password=config.redis_sentinel_password)
        redis_row = check_redis(masked_redis_url(config.redis_url), probed)
    else:
        redis_row = skipped(rows.REDIS, "no Redis URL given")
    return [
        check_cgroup(read_cgroup()),
        check_ulimit(soft, hard),
        check_disk(free, str(disk_at), max(MIN_CACHE_DISK, config.model_size_bytes or 0)),
        check_proxy(env, probe_proxies(proxies)),
        redis_row,
        _engine_port(config, engine),
        check_vllm_version(installed_version(config.engine_python), config.min_vllm, config.preset),
    ]


def _held(device: GpuDevice, engine: RunningEngine | None) -> int:
    """GPU memory our own running engine holds on `device` (0 when none runs or the driver does not say)."""
    if engine is None:
        return 0
    return sum(p.used or 0 for p in device.processes if p.pid in engine.pids)


def _engine_port(config: DoctorConfig, engine: RunningEngine | None) -> Check:
    error = probe_port(config.engine_host, config.engine_port)
    owner = engine.port_owner(config.engine_port) if error is not None and engine is not None else None
    return check_engine_port(config.engine_host, config.engine_port, error, owner)


def _model_checks(config: DoctorConfig, env: Mapping[str, str]) -> list[Check]:
    if config.model is None:
        return [skipped(row, "no --model given") for row in rows.MODEL_ROWS]
    cache = config.cache_dir or hub_cache(env)
    flags = ModelFlags(
        max_model_len=config.max_model_len,
        tokenizer_dir=resolve_model(config.tokenizer, cache) if config.tokenizer else None,
        chat_template=config.chat_template,
        load_format=config.load_format,
        quantization=config.quantization,
        hf_overrides=config.hf_overrides,
        hf_overrides_error=config.hf_overrides_error,
        reasoning_parser=config.reasoning_parser,
    )
    path = resolve_model(config.model, cache)
    checks = check_model_dir(path, flags, model=config.model)
    if path is None or not (path / "config.json").is_file():
        return checks  # no model config: its row already says so, and vLLM has nothing to read
    return engine_checks(checks, _vllm_verdict(config, env, path, flags.tokenizer_dir), config.max_model_len)


def _vllm_verdict(
    config: DoctorConfig, env: Mapping[str, str], path: Path, tokenizer: Path | None
) -> EngineVerdict | str:
    """vLLM's verdict on the engine's argv, with what the doctor was told to check instead (its flags win)."""
    if config.engine_python is None:
        return NOT_INSTALLED
    if not config.ask_vllm:
        return VERDICT_LATER
    args = [*config.engine_args, "--model", str(path)]
    if tokenizer is not None:
        args += ["--tokenizer", str(tokenizer)]
    if config.max_model_len is not None:
        args += ["--max-model-len", str(config.max_model_len)]
    if isinstance(config.chat_template, str | Path):
        args += ["--chat-template", str(config.chat_template)]
    directories = [path] if tokenizer is None else [path, tokenizer]
    engine_env = {**env, **config.engine_env}
    return ask_vllm(config.engine_python, args, engine_env, directories, config.verdict_cache)


def vllm_verdict_checks(config: DoctorConfig) -> list[Check]:
    """The rows vLLM's verdict decides (model config, context length), asked of the installed vLLM (seconds to a
    minute: it imports vLLM); none without a verdict to ask (a custom launcher, no model, no model config)."""
    if config.engine_python is None or config.model is None:
        return []
    env = config.environ if config.environ is not None else os.environ
    decided = (rows.MODEL_CONFIG.name, rows.CONTEXT_LENGTH.name)
    found = _model_checks(replace(config, ask_vllm=True), env)
    return [check for check in found if check.name in decided]


def run_checks(config: DoctorConfig) -> list[Check]:
    """Every check, GPU first, then host, then model; takes a second or two (NVML, Redis ping, file reads)."""
    env = config.environ if config.environ is not None else os.environ
    readings = read_gpus()
    # Only a hand-run doctor names the status file: the supervisor's own preflight counts no engine as ours.
    engine = running_engine(config.engine_status_file) if config.engine_status_file is not None else None
    return [
        *_gpu_checks(config, readings, env, engine),
        *_host_checks(config, env, engine),
        *_model_checks(config, env),
    ]


def doctor_config(settings: Settings, profile: Profile) -> DoctorConfig:
    """What the engine would be started with: the flags of the argv the supervisor builds (profile, extra args)."""
    flags = engine_flags(settings.engine, profile)
    preset = select_preset(load_presets(settings.engine.profiles_file), settings.engine.preset)
    return DoctorConfig(
        model=flags.model,
        tokenizer=flags.tokenizer,
        chat_template=flags.chat_template,
        max_model_len=flags.max_model_len,
        gpu_memory_utilization=flags.gpu_memory_utilization if flags.gpu_memory_utilization is not None else 0.90,
        load_format=flags.load_format,
        quantization=flags.quantization,
        hf_overrides=flags.hf_overrides,
        hf_overrides_error=flags.hf_overrides_error,
        reasoning_parser=flags.reasoning_parser,
        engine_port=settings.engine.port,
        redis_url=settings.redis_url.get_secret_value(),
        redis_sentinel_password=settings.redis.sentinel_password,
        cache_dir=Path(flags.download_dir).expanduser() if flags.download_dir else None,
        # No GPU memory share among the flags: a CPU profile (cpu-dev), no GPU is needed.
        cpu=flags.gpu_memory_utilization is None,
        # A custom launcher does not start the installed vLLM's server: there is no verdict of its to ask for.
        engine_python=None if settings.engine.launcher else engine_python(settings.engine),
        engine_args=tuple(build_argv([], settings.engine, profile)) if settings.engine.model else (),
        # What the supervisor adds to its own environment: the profile's variables, the GPUs, NCCL's defaults.
        engine_env=added_variables(engine_environment(profile, gpus=settings.engine.gpus)),
        verdict_cache=settings.engine.state_dir,
        parallel=Parallelism(
            flags.tensor_parallel_size,
            flags.pipeline_parallel_size,
            flags.data_parallel_size,
            flags.data_parallel_size_local,
        ),
        preset=preset.name,
        preset_needs=preset.needs,
        min_vllm=preset.min_vllm,
        gpu_spread=flags.tensor_parallel_size * flags.pipeline_parallel_size,
    )
