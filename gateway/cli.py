"""The `nemotron-gateway` command line: parses flags into Settings and runs the chosen verb.

Each verb imports only what it runs: the web app (fastapi, the relay) costs ~0.6 s to import, which a
`keys list` must not pay. The verbs' modules are named in `_VERB_MODULES` and loaded with
importlib once the verb is known, rather than imported inside functions (function-local imports
hide the dependency graph, and tests/unit/test_architecture.py refuses them).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from pydantic_settings import SettingsError

from gateway import __version__
from gateway.engine.flags import add_engine_arguments, engine_overrides
from gateway.http.workers import usable_cores
from gateway.metrics.multiprocess import shared_metrics
from gateway.settings import Settings, otel_variables, unknown_variables
from gateway.tracing.otlp import OtlpConfigError, OtlpTraces

logger = logging.getLogger("gateway")

# Flags that map one-to-one onto top-level settings (also settable as NEMOTRON_<FLAG>).
_SETTING_FLAGS = ("host", "port", "engine_url", "redis_url", "log_level", "workers")

# `demo-model` runs a development tool of the repository, found beside the package in a checkout (not in the wheel).
_DEMO_MODEL_WRITER = Path(__file__).resolve().parent.parent / "tools" / "demo_model.py"

# The module that runs each verb (and, for `keys` and `doctor`, declares its flags), imported on demand.
_VERB_MODULES = {
    "serve": "gateway.http.server",
    "engine": "gateway.supervisor.cli",
    "up": "gateway.supervisor.cli",
    "keys": "gateway.auth.cli",
    "doctor": "gateway.doctor",
    "replicas": "gateway.pool.cli",
}
# One line per verb for `--help`; a verb's own flags are declared only when it is the one given.
_VERB_HELP = {
    "serve": "run the gateway in front of a running OpenAI-compatible engine",
    "engine": "run the engine supervisor in the foreground (vllm serve on 127.0.0.1)",
    "keys": "create, list, show, rotate and revoke API keys",
    "demo-model": "write a tiny random-weight Nemotron model and tokenizer (a checkout with the cpu or gpu extra)",
    "doctor": "preflight checks of the GPU, host, model directory and Redis",
    "up": "engine supervisor and gateway together, in the foreground",
    "replicas": "list, drain, restore and restart (rolling) the engine replicas",
}


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--env-file", type=Path, help="read NEMOTRON_* settings from this file as well")
    parser.add_argument("--redis-url", help="Redis URL (NEMOTRON_REDIS_URL)")
    parser.add_argument(
        "--log-level", choices=["critical", "error", "warning", "info", "debug"], help="NEMOTRON_LOG_LEVEL"
    )


def _verb_module(verb: str) -> Any:
    return importlib.import_module(_VERB_MODULES[verb])


def _add_serve(verbs: Any) -> None:
    serve = verbs.add_parser("serve", help=_VERB_HELP["serve"])
    serve.add_argument("--host", help="listen address (NEMOTRON_HOST, default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="listen port (NEMOTRON_PORT, default 8000)")
    serve.add_argument("--engine-url", help="engine base URL (NEMOTRON_ENGINE_URL, default http://127.0.0.1:8001)")
    serve.add_argument(
        "--workers", type=int, help="gateway processes on the one port (NEMOTRON_WORKERS, default: one per usable CPU)"
    )
    _add_common(serve)


def _declare_engine(engine: argparse.ArgumentParser) -> None:
    """The engine command's flags and sub-verbs, the same under `nemotron-gateway engine` and `nemotron-engine`."""
    add_engine_arguments(engine)
    engine.add_argument(
        "--print-argv", action="store_true", help="print the engine's command line and environment; start nothing"
    )
    _add_common(engine)
    engine_verbs = engine.add_subparsers(dest="engine_verb", metavar="[status|profiles|presets]")
    status = engine_verbs.add_parser("status", help="the supervisor's state; exit 0 when the engine is ready")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    _add_common(status)
    _add_common(engine_verbs.add_parser("profiles", help="list the engine profiles and their vLLM flags"))
    _add_common(engine_verbs.add_parser("presets", help="list the model presets, their flags and reasoning switch"))


def _add_engine(verbs: Any) -> None:
    _declare_engine(verbs.add_parser("engine", help=_VERB_HELP["engine"]))


def _add_keys(verbs: Any) -> None:
    _verb_module("keys").add_keys_parser(verbs, _add_common)


def _add_demo_model(verbs: Any) -> None:
    demo = verbs.add_parser("demo-model", help=_VERB_HELP["demo-model"])
    demo.add_argument("directory", type=Path, help="where to write the model")
    demo.add_argument("--seed", type=int, default=0, help="seed for the random weights")


def _add_doctor(verbs: Any) -> None:
    _add_common(_verb_module("doctor").add_doctor_parser(verbs))


def _add_up(verbs: Any) -> None:
    up = verbs.add_parser("up", help=_VERB_HELP["up"])
    up.add_argument("--host", help="gateway listen address (NEMOTRON_HOST)")
    up.add_argument("--port", type=int, help="gateway listen port (NEMOTRON_PORT)")
    add_engine_arguments(up)
    _add_common(up)


def _add_replicas(verbs: Any) -> None:
    _verb_module("replicas").add_replicas_parser(verbs, _add_common)


_VERB_PARSERS: dict[str, Callable[[Any], None]] = {
    "serve": _add_serve,
    "engine": _add_engine,
    "keys": _add_keys,
    "demo-model": _add_demo_model,
    "doctor": _add_doctor,
    "up": _add_up,
    "replicas": _add_replicas,
}


def build_parser(verb: str | None = None) -> argparse.ArgumentParser:
    """The argument parser: every verb in full, or with `verb` only that one (the others as `--help` lines)."""
    parser = argparse.ArgumentParser(prog="nemotron-gateway", description="Front door for a Nemotron model on vLLM.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="COMMAND")
    for name, add in _VERB_PARSERS.items():
        if verb is None or name == verb:
            add(verbs)
        else:
            verbs.add_parser(name, help=_VERB_HELP[name], add_help=False)
    return parser


def _verb_of(argv: Sequence[str]) -> str | None:
    """The verb argv names (its first word that is a verb), or None (top-level `--help`, `--version`)."""
    return next((arg for arg in argv if arg in _VERB_PARSERS), None)


def load_settings(args: argparse.Namespace) -> Settings:
    """Settings from the environment, the env file and the flags given (flags win)."""
    overrides: dict[str, Any] = {
        name: getattr(args, name) for name in _SETTING_FLAGS if getattr(args, name, None) is not None
    }
    if engine := engine_overrides(args):
        overrides["engine"] = engine
    return Settings(_env_file=getattr(args, "env_file", None), **overrides)


class LineFormatter(logging.Formatter):
    """logging's Formatter with the date and time of the record's second formatted once a second, not once a line
    (the access log writes a line per request; `time.strftime` was most of what formatting one cost)."""

    def __init__(self, fmt: str) -> None:
        super().__init__(fmt)
        self._second = -1
        self._stamp = ""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # logging's name
        if datefmt is not None:
            return super().formatTime(record, datefmt)
        second = int(record.created)
        if second != self._second:
            self._second = second
            self._stamp = time.strftime(self.default_time_format, self.converter(record.created))
        return f"{self._stamp},{int(record.msecs):03d}"  # logging's default_msec_format


def configure_logging(level: str) -> None:
    """One plain format for the gateway's and uvicorn's loggers."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(LineFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler])


def _run_engine_verb(args: argparse.Namespace, settings: Settings) -> int:
    module = _verb_module("engine")
    if args.engine_verb == "status":
        return int(module.show_status(settings.engine, as_json=args.json))
    if args.engine_verb == "profiles":
        return int(module.show_profiles(settings.engine))
    if args.engine_verb == "presets":
        return int(module.show_presets(settings.engine))
    if args.print_argv:
        return int(module.print_argv(settings))
    return int(module.run_engine(settings))


def _serve(args: argparse.Namespace, settings: Settings) -> int:
    # Several workers sum their metrics from one directory; prometheus_client picks that mode when it is first
    # imported, so the directory is named before the serving modules are imported.
    with shared_metrics(settings.workers or usable_cores()):
        return int(_verb_module("serve").serve(settings))


_VERB_RUNNERS: dict[str, Callable[[argparse.Namespace, Settings], int]] = {
    "serve": _serve,
    "engine": _run_engine_verb,
    "keys": lambda args, settings: int(_verb_module("keys").run_keys(args, settings)),
    "doctor": lambda args, settings: int(_verb_module("doctor").run_doctor(args, settings)),
    "up": lambda args, settings: int(_verb_module("up").run_up(settings, args.env_file)),
    "replicas": lambda args, settings: int(_verb_module("replicas").run_replicas(args, settings)),
}


# The verbs that start the gateway or the engine, and so read the OTEL_* variables (tracing).
_TRACED_VERBS = frozenset(("serve", "engine", "up"))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `nemotron-gateway` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(_verb_of(argv)).parse_args(argv)
    if args.verb == "demo-model":
        # A child interpreter: the model writer needs torch and tokenizers, which the gateway never imports.
        if not _DEMO_MODEL_WRITER.is_file():
            sys.stderr.write(f"nemotron-gateway demo-model: no {_DEMO_MODEL_WRITER}; run it from a checkout\n")
            return 2
        command = [sys.executable, str(_DEMO_MODEL_WRITER), str(args.directory), "--seed", str(args.seed)]
        return subprocess.run(command, check=False).returncode
    return _run_verb(args)


def engine_parser() -> argparse.ArgumentParser:
    """The parser of `nemotron-engine`: the `engine` verb's, under its own name."""
    parser = argparse.ArgumentParser(prog="nemotron-engine", description=_VERB_HELP["engine"])
    _declare_engine(parser)
    parser.set_defaults(verb="engine")
    return parser


def engine_main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `nemotron-engine` console script (the engine unit's ExecStart) and of
    `python -m gateway.supervisor`: `nemotron-gateway engine` under its own name, the same flags and sub-verbs."""
    return _run_verb(engine_parser().parse_args(sys.argv[1:] if argv is None else argv))


def _run_verb(args: argparse.Namespace) -> int:
    # Logging is configured by the settings, which may fail on such a name: said before, on stderr.
    for warning in unknown_variables(getattr(args, "env_file", None)):
        sys.stderr.write(f"nemotron-gateway: warning: {warning}\n")
    try:
        settings = load_settings(args)
        if args.verb in _TRACED_VERBS:
            OtlpTraces.from_variables(otel_variables())  # a bad OTEL_* value is named here, before anything starts
    except (ValidationError, SettingsError, OtlpConfigError) as exc:
        sys.stderr.write(f"nemotron-gateway: invalid configuration:\n{exc}\n")
        return 2
    configure_logging(settings.log_level)
    return _VERB_RUNNERS[args.verb](args, settings)
