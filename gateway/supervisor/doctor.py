"""Preflight `doctor`: runs every check on this machine, renders a table or JSON, exit code 1 on any failure.

The supervisor calls `run_checks` and refuses to spawn the engine on `fatal_failures`; the CLI (`gateway/cli.py`)
wires `add_doctor_parser` / `run_doctor`. Imports settings and the check modules; never the HTTP app.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from gateway.settings import Settings
from gateway.supervisor.check import NO_GPU, Check, Status, skipped, worst
from gateway.supervisor.checks_gpu import (
    check_cuda_visible_devices,
    check_device_nodes,
    check_driver_vs_torch,
    check_flash_attn,
    check_gpu_memory,
    check_gpu_present,
    check_pcie,
    flash_attn_libraries,
    read_flash_attn_build,
    read_torch_build,
)
from gateway.supervisor.checks_host import (
    MIN_CACHE_DISK,
    check_cgroup,
    check_disk,
    check_engine_port,
    check_proxy,
    check_redis,
    check_ulimit,
    mask_url,
    probe_port,
    probe_proxies,
    probe_redis,
    proxy_settings,
    read_cgroup,
    read_free_disk,
    read_open_files,
)
from gateway.supervisor.checks_model import check_model_dir, resolve_model
from gateway.supervisor.nvml import GpuDevice, GpuReadings, device_nodes, read_gpus
from gateway.supervisor.profiles import Profile, ProfileError, load_profiles, select_profile

__all__ = [
    "Check",
    "DoctorConfig",
    "Status",
    "add_doctor_parser",
    "exit_code",
    "fatal_failures",
    "render_json",
    "render_table",
    "run_checks",
    "run_doctor",
]

_GPU_ROWS = (
    ("driver vs torch CUDA", True),
    ("compute capability vs flash-attn", False),
    ("GPU memory free", True),
    ("CUDA_VISIBLE_DEVICES", True),
    ("PCIe link", False),
)
_MODEL_ROWS = (
    "model directory",
    "model config",
    "tokenizer",
    "chat template",
    "BOS token",
    "rope_theta",
    "context length",
)
_FATAL_MODEL_ROWS = {"model directory", "model config", "tokenizer", "context length"}
_COLUMN = 56  # measured and fix wrap at this width in the table


@dataclass(frozen=True)
class DoctorConfig:
    """What the engine is about to be started with; the supervisor fills it from the profile."""

    model: str | None = None  # a local directory or a hub id (org/name)
    tokenizer: str | None = None  # --tokenizer, where it differs from the model (AWQ profile)
    chat_template: Path | None = None  # --chat-template, where the profile passes one
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.90
    engine_host: str = "127.0.0.1"
    engine_port: int = 8001
    redis_url: str | None = None  # None: the Redis row is skipped
    cache_dir: Path | None = None  # None: HF_HUB_CACHE / HF_HOME / ~/.cache/huggingface
    model_size_bytes: int | None = None  # raises the free-disk floor above 15 GB when known
    cpu: bool = False  # the CPU profile: no GPU is needed
    environ: Mapping[str, str] | None = None  # None: this process's environment


def hub_cache(env: Mapping[str, str]) -> Path:
    """Where huggingface_hub keeps downloads, by its own rules."""
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    base = Path(env["XDG_CACHE_HOME"]).expanduser() if env.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return base / "huggingface" / "hub"


def _visible(devices: Sequence[GpuDevice], value: str | None) -> list[GpuDevice]:
    """The GPUs CUDA will use (NVML ignores CUDA_VISIBLE_DEVICES); all of them if it names none."""
    if value is None:
        return list(devices)
    chosen: list[GpuDevice] = []
    for token in (t.strip() for t in value.split(",")):
        match = [
            d for d in devices if token and ((token.isdigit() and d.index == int(token)) or d.uuid.startswith(token))
        ]
        if len(match) != 1:
            break
        chosen.append(match[0])
    return chosen or list(devices)


def _gpu_checks(config: DoctorConfig, readings: GpuReadings, env: Mapping[str, str]) -> list[Check]:
    present = check_gpu_present(readings, config.cpu)
    nodes = check_device_nodes(device_nodes(), bool(readings.devices))
    if not readings.devices or config.cpu:
        why = "skipped: CPU profile" if readings.devices else NO_GPU
        return [present, *(skipped(name, why, fatal=fatal) for name, fatal in _GPU_ROWS), nodes]
    torch = read_torch_build()
    flash = read_flash_attn_build(flash_attn_libraries())
    visible = _visible(readings.devices, env.get("CUDA_VISIBLE_DEVICES"))
    labels = [f"GPU {d.index}" for d in visible]
    driver = check_driver_vs_torch(
        readings.cuda_driver,
        torch.cuda if torch else None,
        readings.driver_version or "",
        torch.version if torch else "",
    )
    return [
        present,
        driver,
        worst(_GPU_ROWS[1][0], [check_flash_attn(d.compute_capability, flash) for d in visible], labels),
        worst(
            _GPU_ROWS[2][0],
            [check_gpu_memory(d.memory_free, d.memory_total, config.gpu_memory_utilization) for d in visible],
            labels,
        ),
        check_cuda_visible_devices(
            env.get("CUDA_VISIBLE_DEVICES"), len(readings.devices), [d.uuid for d in readings.devices]
        ),
        worst(
            _GPU_ROWS[4][0],
            [check_pcie(d.pcie.gen, d.pcie.width, d.pcie.max_gen, d.pcie.max_width) for d in visible],
            labels,
        ),
        nodes,
    ]


def _host_checks(config: DoctorConfig, env: Mapping[str, str]) -> list[Check]:
    soft, hard = read_open_files()
    disk_at, free = read_free_disk(config.cache_dir or hub_cache(env))
    proxies = proxy_settings(env)
    if config.redis_url:
        redis_row = check_redis(mask_url(config.redis_url), probe_redis(config.redis_url))
    else:
        redis_row = skipped("Redis", "no Redis URL given")
    return [
        check_cgroup(read_cgroup()),
        check_ulimit(soft, hard),
        check_disk(free, str(disk_at), max(MIN_CACHE_DISK, config.model_size_bytes or 0)),
        check_proxy(env, probe_proxies(proxies)),
        redis_row,
        check_engine_port(config.engine_host, config.engine_port, probe_port(config.engine_host, config.engine_port)),
    ]


def _model_checks(config: DoctorConfig, env: Mapping[str, str]) -> list[Check]:
    if config.model is None:
        return [skipped(name, "no --model given", fatal=name in _FATAL_MODEL_ROWS) for name in _MODEL_ROWS]
    cache = hub_cache(env)
    tokenizer_dir = resolve_model(config.tokenizer, cache) if config.tokenizer else None
    return check_model_dir(
        resolve_model(config.model, cache),
        config.max_model_len,
        tokenizer_dir=tokenizer_dir,
        chat_template=config.chat_template,
        model=config.model,
    )


def run_checks(config: DoctorConfig) -> list[Check]:
    """Every check, GPU first, then host, then model; takes a second or two (NVML, Redis ping, file reads)."""
    env = config.environ if config.environ is not None else os.environ
    readings = read_gpus()
    return [*_gpu_checks(config, readings, env), *_host_checks(config, env), *_model_checks(config, env)]


def fatal_failures(checks: Sequence[Check]) -> list[Check]:
    """The failures that make the supervisor refuse to spawn the engine."""
    return [c for c in checks if c.blocks_start]


def exit_code(checks: Sequence[Check]) -> int:
    """1 if any check failed (fatal or not), else 0: warnings do not fail the doctor."""
    return int(any(c.status is Status.FAIL for c in checks))


def _cell(text: str, width: int) -> list[str]:
    return textwrap.wrap(text, width, break_on_hyphens=False) or [""]


def render_table(checks: Sequence[Check]) -> str:
    """Aligned columns STATUS, CHECK, MEASURED, FIX (long cells wrap); fatal failures marked `FAIL*`."""
    labels = [c.status.value.upper() + ("*" if c.blocks_start else "") for c in checks]
    name_width = max([len("CHECK"), *(len(c.name) for c in checks)])
    measured_width = min(_COLUMN, max([len("MEASURED"), *(len(c.measured) for c in checks)]))
    lines = [f"{'STATUS':<6}  {'CHECK':<{name_width}}  {'MEASURED':<{measured_width}}  FIX"]
    for label, check in zip(labels, checks, strict=True):
        measured, fix = _cell(check.measured, measured_width), _cell(check.fix, _COLUMN)
        for i in range(max(len(measured), len(fix))):
            row = [
                label if i == 0 else "",
                check.name if i == 0 else "",
                measured[i] if i < len(measured) else "",
            ]
            text = f"{row[0]:<6}  {row[1]:<{name_width}}  {row[2]:<{measured_width}}  {fix[i] if i < len(fix) else ''}"
            lines.append(text.rstrip())
    counts = {s: sum(c.status is s for c in checks) for s in Status}
    summary = ", ".join(f"{counts[s]} {s.value}" for s in Status)
    fatal = fatal_failures(checks)
    lines.append("")
    lines.append(summary + (f"; * fatal: the supervisor will not start the engine ({len(fatal)})" if fatal else ""))
    return "\n".join(lines) + "\n"


def render_json(checks: Sequence[Check]) -> str:
    """{"exit_code", "fatal_failures": [names], "checks": [{name, status, measured, fix, fatal}]}."""
    body = {
        "exit_code": exit_code(checks),
        "fatal_failures": [c.name for c in fatal_failures(checks)],
        "checks": [{**asdict(c), "status": c.status.value} for c in checks],
    }
    return json.dumps(body, indent=2) + "\n"


def add_doctor_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """The `doctor` verb and its flags (defaults: the profiles' common values)."""
    parser = subparsers.add_parser("doctor", help="check this machine, the model and Redis before starting the engine")
    parser.add_argument(
        "--model", help="model directory or hub id (default NEMOTRON_ENGINE__MODEL; model rows skipped without one)"
    )
    parser.add_argument("--tokenizer", help="tokenizer directory or hub id, where it differs from the model")
    parser.add_argument("--chat-template", type=Path, help="the chat template file the engine will be given")
    parser.add_argument("--max-model-len", type=int, help="context length to serve (default: the profile's)")
    parser.add_argument(
        "--gpu-memory-utilization", type=float, help="share of GPU memory vLLM takes (default: the profile's)"
    )
    parser.add_argument("--profile", help="engine profile whose values are checked (default NEMOTRON_ENGINE__PROFILE)")
    parser.add_argument("--engine-port", type=int, help="port vllm serve binds on 127.0.0.1 (default: the engine's)")
    parser.add_argument("--cache-dir", type=Path, help="model cache directory (default: HF_HUB_CACHE / HF_HOME)")
    parser.add_argument("--cpu", action="store_true", help="the CPU profile: a missing GPU is not a failure")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    return parser


def doctor_config(settings: Settings, profile: Profile) -> DoctorConfig:
    """What the engine would be started with: the settings and the profile's flags."""
    flags = profile.flags
    max_model_len = flags.get("max-model-len")
    utilization = flags.get("gpu-memory-utilization")
    return DoctorConfig(
        model=settings.engine.model,
        tokenizer=str(flags["tokenizer"]) if "tokenizer" in flags else None,
        chat_template=Path(str(flags["chat-template"])) if "chat-template" in flags else None,
        max_model_len=int(max_model_len) if isinstance(max_model_len, int) else None,
        gpu_memory_utilization=float(utilization) if isinstance(utilization, int | float) else 0.90,
        engine_port=settings.engine.port,
        redis_url=settings.redis_url.get_secret_value(),
        # A profile without a GPU memory share is a CPU profile (cpu-dev): no GPU is needed.
        cpu=utilization is None,
    )


def run_doctor(args: argparse.Namespace, settings: Settings) -> int:
    """Run every check for the configured engine (flags override), write the table or JSON, return the exit code."""
    if args.profile is not None:
        settings = settings.model_copy(update={"engine": settings.engine.model_copy(update={"profile": args.profile})})
    try:
        profile = select_profile(load_profiles(settings.engine.profiles_file), settings.engine.profile)
    except ProfileError as exc:
        sys.stderr.write(f"nemotron-gateway doctor: {exc}\n")
        return 2
    config = replace(
        doctor_config(settings, profile),
        **{
            name: value
            for name, value in {
                "model": args.model,
                "tokenizer": args.tokenizer,
                "chat_template": args.chat_template,
                "max_model_len": args.max_model_len,
                "gpu_memory_utilization": args.gpu_memory_utilization,
                "engine_port": args.engine_port,
                "cache_dir": args.cache_dir,
                "cpu": True if args.cpu else None,
            }.items()
            if value is not None
        },
    )
    checks = run_checks(config)
    sys.stdout.write(render_json(checks) if args.json else render_table(checks))
    return exit_code(checks)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m gateway.supervisor.doctor`: the doctor alone, settings from the environment."""
    parser = argparse.ArgumentParser(prog="nemotron-gateway")
    add_doctor_parser(parser.add_subparsers(dest="verb", required=True))
    return run_doctor(parser.parse_args(["doctor", *(argv if argv is not None else sys.argv[1:])]), Settings())


if __name__ == "__main__":
    raise SystemExit(main())
