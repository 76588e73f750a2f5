"""The `doctor` verb: its flags, the configuration it checks, and the report on stdout (exit 1 on any failure).

The CLI (`gateway/cli.py`) wires `add_doctor_parser` / `run_doctor`; `python -m gateway.doctor` runs it alone.
Imports settings, the engine package's profiles and the doctor's own modules; never the HTTP app.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from pydantic_settings import SettingsError

from gateway.doctor import rows
from gateway.doctor.check import Check, Status
from gateway.doctor.report import exit_code, render_json, render_table
from gateway.doctor.runner import DoctorConfig, doctor_config, run_checks
from gateway.engine.presets import engine_profile
from gateway.engine.profiles import Profile, ProfileError
from gateway.engine.replicas import available_gpus, replica_settings, split_gpus
from gateway.engine.supervisor_state import RUNNING_ENV, STATUS_FILE
from gateway.settings import Settings

# The rows that differ between the replicas of one host (their GPUs, their port); the others are checked once.
_PER_REPLICA = frozenset(row.name for row in (*rows.GPU_ROWS, rows.ENGINE_PORT))


def add_doctor_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """The `doctor` verb and its flags (defaults: the profiles' common values)."""
    parser = subparsers.add_parser("doctor", help="check this machine, the model and Redis before starting the engine")
    parser.add_argument(
        "--model", help="model directory or hub id (default NEMOTRON_ENGINE__MODEL; model rows skipped without one)"
    )
    parser.add_argument("--tokenizer", help="tokenizer directory or hub id, where it differs from the model")
    parser.add_argument("--chat-template", help="the chat template the engine will be given (a file, or inline)")
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


def running_settings(args: argparse.Namespace, settings: Settings) -> tuple[Settings, Path | None]:
    """The settings of the running supervisor (the env file it writes in its state dir), when no --env-file is given.

    Without them a hand-run doctor would check the default profile, Redis URL and model instead of the running
    ones. The doctor's own flags still win, as they do over any env file.
    """
    run_env = settings.engine.state_dir / RUNNING_ENV
    if getattr(args, "env_file", None) is not None or not run_env.is_file():
        return settings, None
    engine = {"model": args.model, "profile": args.profile, "port": args.engine_port}
    top = {name: getattr(args, name, None) for name in ("redis_url", "log_level")}
    overrides: dict[str, Any] = {k: v for k, v in top.items() if v is not None}
    if given := {k: v for k, v in engine.items() if v is not None}:
        overrides["engine"] = given
    return Settings(_env_file=run_env, **overrides), run_env


def run_doctor(args: argparse.Namespace, settings: Settings) -> int:
    """Run every check for the configured engine (flags override), write the table or JSON, return the exit code."""
    try:
        settings, run_env = running_settings(args, settings)
    except (ValidationError, SettingsError) as exc:
        sys.stderr.write(
            f"nemotron-gateway doctor: invalid settings in {settings.engine.state_dir / RUNNING_ENV}:\n{exc}\n"
        )
        return 2
    if run_env is not None:
        sys.stderr.write(f"nemotron-gateway doctor: checking the running stack's settings from {run_env}\n")
    if args.profile is not None:
        settings = settings.model_copy(update={"engine": settings.engine.model_copy(update={"profile": args.profile})})
    try:
        profile, _ = engine_profile(settings.engine)
    except ProfileError as exc:
        sys.stderr.write(f"nemotron-gateway doctor: {exc}\n")
        return 2
    config = replace(
        doctor_config(settings, profile),
        engine_status_file=settings.engine.state_dir / STATUS_FILE,
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
    if settings.engine.replicas > 1 and args.engine_port is None:
        checks = _replica_checks(settings, profile, config)
    else:
        checks = run_checks(config)
    sys.stdout.write(render_json(checks) if args.json else render_table(checks))
    return exit_code(checks)


def _replica_checks(settings: Settings, profile: Profile, config: DoctorConfig) -> list[Check]:
    """Every check for the first replica, and the GPU and port rows of each (named `... (replica i)`), each with the
    GPUs its supervisor gives it."""
    try:
        gpus: list[str | None] = (
            [settings.engine.gpus] * settings.engine.replicas
            if config.cpu
            else list(split_gpus(available_gpus(settings.engine), config.parallel.gpus, settings.engine.replicas))
        )
    except ProfileError as exc:
        missing = Check(
            "GPUs for the replicas", Status.FAIL, str(exc), "see `nemotron-gateway engine --print-argv`", fatal=True
        )
        return [missing, *run_checks(config)]
    checks: list[Check] = []
    for index, own in enumerate(gpus):
        mine = replica_settings(settings, index, own)
        replica_config = replace(
            config,
            engine_port=mine.engine.port,
            engine_env=doctor_config(mine, profile).engine_env,
            engine_status_file=settings.engine.replica_state_dir(index) / STATUS_FILE,
        )
        if index > 0:  # the model is the same: its rows (and vLLM's verdict) once, for the first
            replica_config = replace(replica_config, model=None, ask_vllm=False)
        for check in run_checks(replica_config):
            if check.name in _PER_REPLICA:
                checks.append(replace(check, name=f"{check.name} (replica {index})"))
            elif index == 0:
                checks.append(check)
    return checks


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m gateway.doctor`: the doctor alone, settings from the environment."""
    parser = argparse.ArgumentParser(prog="nemotron-gateway")
    add_doctor_parser(parser.add_subparsers(dest="verb", required=True))
    return run_doctor(parser.parse_args(["doctor", *(argv if argv is not None else sys.argv[1:])]), Settings())
