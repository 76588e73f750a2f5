"""The `nemotron-gateway` command line: parses flags into Settings and runs the chosen verb."""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import uvicorn
from pydantic import ValidationError
from pydantic_settings import SettingsError

from gateway import __version__
from gateway.app import create_app
from gateway.auth.cli import add_keys_parser, run_keys
from gateway.doctor import add_doctor_parser, run_doctor
from gateway.settings import Settings
from gateway.supervisor.cli import (
    add_engine_arguments,
    engine_overrides,
    run_engine,
    run_up,
    show_profiles,
    show_status,
)

logger = logging.getLogger("gateway")

# Flags that map one-to-one onto top-level settings (also settable as NEMOTRON_<FLAG>).
_SETTING_FLAGS = ("host", "port", "engine_url", "redis_url", "log_level")


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--env-file", type=Path, help="read NEMOTRON_* settings from this file as well")
    parser.add_argument("--redis-url", help="Redis URL (NEMOTRON_REDIS_URL)")
    parser.add_argument(
        "--log-level", choices=["critical", "error", "warning", "info", "debug"], help="NEMOTRON_LOG_LEVEL"
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    parser = argparse.ArgumentParser(prog="nemotron-gateway", description="Front door for a Nemotron model on vLLM.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="COMMAND")
    serve = verbs.add_parser("serve", help="run the gateway in front of a running OpenAI-compatible engine")
    serve.add_argument("--host", help="listen address (NEMOTRON_HOST, default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="listen port (NEMOTRON_PORT, default 8000)")
    serve.add_argument("--engine-url", help="engine base URL (NEMOTRON_ENGINE_URL, default http://127.0.0.1:8001)")
    _add_common(serve)

    engine = verbs.add_parser("engine", help="run the engine supervisor in the foreground (vllm serve on 127.0.0.1)")
    add_engine_arguments(engine)
    _add_common(engine)
    engine_verbs = engine.add_subparsers(dest="engine_verb", metavar="[status|profiles]")
    status = engine_verbs.add_parser("status", help="the supervisor's state; exit 0 when the engine is ready")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    _add_common(status)
    _add_common(engine_verbs.add_parser("profiles", help="list the engine profiles and their vLLM flags"))

    add_keys_parser(verbs, _add_common)

    demo = verbs.add_parser(
        "demo-model", help="write a tiny random-weight Nemotron model and tokenizer (needs the cpu or gpu extra)"
    )
    demo.add_argument("directory", type=Path, help="where to write the model")
    demo.add_argument("--seed", type=int, default=0, help="seed for the random weights")

    doctor = add_doctor_parser(verbs)
    _add_common(doctor)

    up = verbs.add_parser("up", help="engine supervisor and gateway together, in the foreground")
    up.add_argument("--host", help="gateway listen address (NEMOTRON_HOST)")
    up.add_argument("--port", type=int, help="gateway listen port (NEMOTRON_PORT)")
    add_engine_arguments(up)
    _add_common(up)
    return parser


def load_settings(args: argparse.Namespace) -> Settings:
    """Settings from the environment, the env file and the flags given (flags win)."""
    overrides: dict[str, Any] = {
        name: getattr(args, name) for name in _SETTING_FLAGS if getattr(args, name, None) is not None
    }
    if engine := engine_overrides(args):
        overrides["engine"] = engine
    return Settings(_env_file=getattr(args, "env_file", None), **overrides)


def configure_logging(level: str) -> None:
    """One plain format for the gateway's and uvicorn's loggers."""
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )


def serve(settings: Settings) -> int:
    """Run the gateway under uvicorn until SIGTERM/SIGINT (open streams get `shutdown_grace` to finish)."""
    logger.info("effective settings: %s", json.dumps(settings.masked()))
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        access_log=False,
        log_config=None,
        proxy_headers=True,
        forwarded_allow_ips=settings.trusted_proxies,
        timeout_graceful_shutdown=int(settings.shutdown_grace),
        server_header=False,
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `nemotron-gateway` console script."""
    args = build_parser().parse_args(argv)
    if args.verb == "demo-model":
        # A child interpreter: the model writer needs torch and tokenizers, which the gateway never imports.
        command = [sys.executable, "-m", "gateway.demo_model", str(args.directory), "--seed", str(args.seed)]
        return subprocess.run(command, check=False).returncode
    try:
        settings = load_settings(args)
    except (ValidationError, SettingsError) as exc:
        sys.stderr.write(f"nemotron-gateway: invalid configuration:\n{exc}\n")
        return 2
    configure_logging(settings.log_level)
    if args.verb == "serve":
        return serve(settings)
    if args.verb == "engine":
        if args.engine_verb == "status":
            return show_status(settings, as_json=args.json)
        if args.engine_verb == "profiles":
            return show_profiles(settings)
        return run_engine(settings)
    if args.verb == "keys":
        return run_keys(args, settings)
    if args.verb == "doctor":
        return run_doctor(args, settings)
    if args.verb == "up":
        return run_up(settings, args.env_file)
    raise AssertionError(f"unhandled verb {args.verb}")
