"""Model presets: what one Nemotron family needs from `vllm serve` (data in presets.toml plus the operator's file).

A preset holds the model's flags (parsers, chat template, config fixes), its context length and how the model
switches reasoning; it combines with any profile (the hardware's flags) into the one `Profile` the argv builder,
the supervisor and the doctor read. The gateway reads only the reasoning switch. Imports settings and profiles.
"""

from __future__ import annotations

import enum
import importlib.util
import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gateway.engine.profiles import (
    Profile,
    ProfileError,
    fold_extends,
    load_profiles,
    read_tables,
    select_profile,
)
from gateway.settings import EngineSettings

__all__ = [
    "Preset",
    "ReasoningSwitch",
    "apply_preset",
    "engine_profile",
    "load_presets",
    "reasoning_switch",
    "select_preset",
    "shipped_template",
]

# Keys of a preset table that are not vLLM flags.
_META_KEYS = frozenset(("extends", "description", "env", "model", "reasoning", "context-length", "sources"))
_RESERVED_FLAGS = frozenset(("host", "port", "served-model-name", "model", "max-model-len"))
# `chat-template = "shipped:NAME"` names a template engine_patches ships (resolved to its installed path).
_SHIPPED = "shipped:"
_MAX_LEN = "max-model-len"


class ReasoningSwitch(enum.StrEnum):
    """How a model turns its reasoning on and off; the gateway translates a client's switch into it."""

    NONE = "none"  # no reasoning mode: the switch is ignored
    # `chat_template_kwargs.enable_thinking` (Nemotron 3 Nano's template reads it)
    ENABLE_THINKING = "enable_thinking"
    # a `/think` or `/no_think` line in the system message (Nano-9B-v2, Super-49B-v1.5)
    THINK_LINE = "think_line"
    # `detailed thinking on` / `detailed thinking off` as the system message (Llama-3.1-Nemotron-Nano-8B-v1)
    DETAILED_THINKING = "detailed_thinking"


@dataclass(frozen=True)
class Preset:
    """One resolved preset: the model's flags, its context length and its reasoning switch."""

    name: str
    description: str
    flags: Mapping[str, Any]
    env: Mapping[str, str] = field(default_factory=dict)
    model: str | None = None  # the hub id the preset was written for (shown, never forced)
    context_length: int | None = None  # --max-model-len unless the profile caps it lower; None: vLLM derives it
    reasoning: ReasoningSwitch = ReasoningSwitch.NONE


def shipped_template(name: str) -> Path:
    """The installed path of a chat template engine_patches ships (`templates/<name>.jinja`).

    Found with find_spec, which locates the package without importing it: the plugin is vLLM's, never ours.
    """
    spec = importlib.util.find_spec("engine_patches")
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    path = Path(roots[0] if roots else ".", "templates", f"{name}.jinja")
    if not roots or not path.is_file():
        raise ProfileError(f"no shipped chat template {name!r} (engine_patches/templates/{name}.jinja)")
    return path


def load_presets(operator_file: Path | None = None) -> dict[str, Preset]:
    """The shipped presets, overlaid by the operator's file (the same file as their profiles)."""
    raw = read_tables("presets", operator_file)
    return {name: _resolve(name, raw) for name in raw}


def _flag_value(name: str, key: str, value: Any) -> str | int | float | bool:
    if key == "hf-overrides" and isinstance(value, dict):
        return json.dumps(value, separators=(",", ":"))
    if key == "chat-template" and isinstance(value, str) and value.startswith(_SHIPPED):
        return str(shipped_template(value.removeprefix(_SHIPPED)))
    if not isinstance(value, str | int | float | bool):
        raise ProfileError(f"preset {name!r}: --{key} must be a string, number or boolean")
    return value


def _preset_flag(name: str, key: str, value: Any) -> str | int | float | bool:
    if key in _RESERVED_FLAGS:
        where = "context-length" if key == _MAX_LEN else "the engine settings"
        raise ProfileError(f"preset {name!r} sets --{key}; that comes from {where}")
    return _flag_value(name, key, value)


def _resolve(name: str, raw: Mapping[str, Mapping[str, Any]]) -> Preset:
    folded = fold_extends("preset", name, raw, _META_KEYS, _preset_flag)
    try:
        reasoning = ReasoningSwitch(folded.inherited("reasoning", "none"))
    except ValueError:
        choices = ", ".join(s.value for s in ReasoningSwitch)
        raise ProfileError(f"preset {name!r}: reasoning must be one of {choices}") from None
    length = folded.inherited("context-length")
    if length is not None and (not isinstance(length, int) or isinstance(length, bool) or length < 1):
        raise ProfileError(f"preset {name!r}: context-length must be a positive whole number")
    return Preset(
        name=name,
        description=str(raw[name].get("description", "")),
        flags=folded.flags,
        env=folded.env,
        model=folded.inherited("model"),
        context_length=length,
        reasoning=reasoning,
    )


def select_preset(presets: Mapping[str, Preset], name: str) -> Preset:
    """The named preset, or a ProfileError listing the choices."""
    preset = presets.get(name)
    if preset is None:
        raise ProfileError(f"unknown model preset {name!r}; choose one of: {', '.join(sorted(presets))}")
    return preset


def apply_preset(profile: Profile, preset: Preset) -> Profile:
    """The profile with the preset's flags first; a flag both set takes the profile's value (the operator's
    hardware choice), except the context length: the preset's, capped by the profile's `max-model-len`."""
    flags: dict[str, Any] = dict(preset.flags)
    cap = profile.flags.get(_MAX_LEN)
    lengths = [n for n in (preset.context_length, cap) if isinstance(n, int) and not isinstance(n, bool)]
    flags.update({k: v for k, v in profile.flags.items() if k != _MAX_LEN})
    if lengths:
        flags[_MAX_LEN] = min(lengths)
    description = f"{preset.name}: {preset.description} | {profile.name}: {profile.description}"
    return replace(profile, flags=flags, env={**preset.env, **profile.env}, description=description)


def engine_profile(engine: EngineSettings) -> tuple[Profile, Preset]:
    """The configured profile combined with the configured preset (both from the shipped and operator files)."""
    profile = select_profile(load_profiles(engine.profiles_file), engine.profile)
    preset = select_preset(load_presets(engine.profiles_file), engine.preset)
    return apply_preset(profile, preset), preset


def reasoning_switch(preset: str, profiles_file: Path | None = None) -> ReasoningSwitch:
    """How the named preset's model switches reasoning (what the gateway translates a client's switch into)."""
    return select_preset(load_presets(profiles_file), preset).reasoning
