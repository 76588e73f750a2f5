"""The engine's effective flags: read from the `vllm serve` argv the supervisor builds (profile, then extra args).

The doctor checks what vLLM will be told, not what one profile says: `--load-format dummy` needs no weights,
`--tokenizer` moves the tokenizer files elsewhere, `--hf-overrides` changes the config the context length is
derived from. Parsing follows vLLM's argparse: `--flag value` or `--flag=value`, the last occurrence wins,
`--hf-overrides.key value` sets one key. Imports settings and the engine package's argv builder.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from gateway.engine.profiles import Profile, build_argv
from gateway.settings import EngineSettings

# build_argv refuses an argv without a model; the doctor still checks the rest of an unconfigured machine.
_NO_MODEL = "\0no-model"
_HUMAN_INT = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
# vLLM's short names of the parallel sizes (vllm/engine/arg_utils.py).
_SHORT = {
    "-tp": "tensor-parallel-size",
    "-pp": "pipeline-parallel-size",
    "-dp": "data-parallel-size",
    "-dpl": "data-parallel-size-local",
}


@dataclass(frozen=True)
class EngineFlags:
    """The flags of one engine argv that change what the machine and the model directory must hold."""

    model: str | None = None
    tokenizer: str | None = None
    chat_template: str | None = None  # a file path or, as vLLM allows, the template itself
    max_model_len: int | None = None  # None: not given, or `auto` / -1 (the model's own length)
    gpu_memory_utilization: float | None = None  # None: a CPU profile (cpu-dev sets none)
    load_format: str | None = None  # lowercased, as vLLM compares it
    quantization: str | None = None
    hf_overrides: Mapping[str, Any] = field(default_factory=dict)
    hf_overrides_error: str | None = None  # --hf-overrides given but not a JSON object
    download_dir: str | None = None  # where vLLM looks for (and puts) hub downloads instead of the HF cache
    reasoning_parser: str | None = None
    # The parallel sizes (vLLM's default 1; data_parallel_size_local None: all data-parallel ranks on this host).
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    data_parallel_size_local: int | None = None


def _options(argv: Sequence[str]) -> list[tuple[str, str | None]]:
    """(name without dashes, value or None for a bare flag) in argv order."""
    found: list[tuple[str, str | None]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        short, eq, rest = arg.partition("=")
        if short in _SHORT:
            arg = f"--{_SHORT[short]}{eq}{rest}"
        if not arg.startswith("--"):
            continue
        name, eq, value = arg[2:].partition("=")
        if eq:
            found.append((name, value))
        elif i < len(argv) and not argv[i].startswith("--"):
            found.append((name, argv[i]))
            i += 1
        else:
            found.append((name, None))
    return found


def human_int(text: str) -> int | None:
    """vLLM's `human_readable_int`: 4096, 4k (4000), 4K (4096); None for anything else."""
    text = text.strip()
    if text.lstrip("-").isdigit():
        return int(text)
    match = _HUMAN_INT.fullmatch(text)
    if match is None:
        return None
    number, suffix = match.groups()
    if suffix in _DECIMAL:
        return int(float(number) * _DECIMAL[suffix])
    return int(number) * _BINARY[suffix] if number.isdigit() else None


def _json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _set_dotted(target: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    for key in parents:
        target = target.setdefault(key, {})
    target[last] = value


def parse_flags(argv: Sequence[str]) -> EngineFlags:
    """The flags the doctor needs from a `vllm serve` argv (launcher prefix or not)."""
    values: dict[str, str | None] = {}
    overrides: dict[str, Any] = {}
    overrides_error: str | None = None
    for name, value in _options(argv):
        if name == "hf-overrides" and value is not None:
            parsed = _json_value(value)
            if isinstance(parsed, dict):
                overrides.update(parsed)
            else:
                overrides_error = f"--hf-overrides {value!r} is not a JSON object"
        elif name.startswith("hf-overrides.") and value is not None:
            _set_dotted(overrides, name.removeprefix("hf-overrides."), _json_value(value))
        else:
            values[name] = value
    max_len = human_int(values["max-model-len"] or "") if "max-model-len" in values else None
    if values.get("max-model-len") == "auto" or (max_len is not None and max_len < 0):
        max_len = None
    utilization = values.get("gpu-memory-utilization")
    try:
        share = float(utilization) if utilization is not None else None
    except ValueError:
        share = None
    return EngineFlags(
        model=values.get("model"),
        tokenizer=values.get("tokenizer"),
        chat_template=values.get("chat-template"),
        max_model_len=max_len,
        gpu_memory_utilization=share,
        load_format=(values.get("load-format") or "").lower() or None,
        quantization=values.get("quantization") or None,
        hf_overrides=overrides,
        hf_overrides_error=overrides_error,
        download_dir=values.get("download-dir"),
        reasoning_parser=values.get("reasoning-parser") or None,
        tensor_parallel_size=_size(values.get("tensor-parallel-size")) or 1,
        pipeline_parallel_size=_size(values.get("pipeline-parallel-size")) or 1,
        data_parallel_size=_size(values.get("data-parallel-size")) or 1,
        data_parallel_size_local=_size(values.get("data-parallel-size-local")),
    )


def _size(text: str | None) -> int | None:
    """A parallel size as vLLM's argparse reads it (a whole number), None when absent or not one."""
    return int(text) if text is not None and text.strip().isdigit() and int(text) > 0 else None


def engine_flags(engine: EngineSettings, profile: Profile) -> EngineFlags:
    """The effective flags of the engine the supervisor would start: its own argv builder, without a launcher."""
    configured = engine if engine.model else engine.model_copy(update={"model": _NO_MODEL})
    flags = parse_flags(build_argv([], configured, profile))
    return flags if engine.model else replace(flags, model=None)
