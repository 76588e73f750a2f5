"""Engine profiles (data in profiles.toml plus the operator's file) and the pure `vllm serve` argv builder.

Imports settings and errors only.
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from gateway.settings import EngineSettings

ENGINE_HOST = "127.0.0.1"
_META_KEYS = frozenset(("extends", "description", "env", "hidden"))
# Set by the supervisor itself from settings; a profile naming them would fight the settings.
_RESERVED_FLAGS = frozenset(("host", "port", "served-model-name", "model"))


class ProfileError(Exception):
    """An unknown profile, a malformed profile file, or a flag the installed vLLM does not accept."""


@dataclass(frozen=True)
class Profile:
    """One resolved profile: its flags in order (inherited first) and the engine's extra environment."""

    name: str
    description: str
    flags: Mapping[str, Any]
    env: Mapping[str, str] = field(default_factory=dict)
    hidden: bool = False


_SECTIONS = frozenset(("profiles", "presets"))


def _read_tables(text: str, origin: str, section: str) -> dict[str, dict[str, Any]]:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"{origin} is not valid TOML: {exc}") from None
    # An operator's file may hold profiles, presets or both; one with neither is a mistake.
    table = data.get(section, {} if _SECTIONS & data.keys() else None)
    if not isinstance(table, dict) or not all(isinstance(v, dict) for v in table.values()):
        raise ProfileError(f"{origin} must contain [{section}.<name>] tables")
    return table


def read_tables(section: str, operator_file: Path | None) -> dict[str, dict[str, Any]]:
    """The shipped `<section>.toml`'s `[<section>.<name>]` tables, overlaid by the operator's file (a table
    there replaces or adds one). `section` is "profiles" or "presets"."""
    shipped = resources.files("gateway.engine").joinpath(f"{section}.toml").read_text("utf-8")
    raw = _read_tables(shipped, f"{section}.toml", section)
    if operator_file is not None:
        try:
            text = operator_file.read_text("utf-8")
        except OSError as exc:
            raise ProfileError(f"cannot read the profiles file {operator_file}: {exc.strerror}") from None
        raw.update(_read_tables(text, str(operator_file), section))
    return raw


def load_profiles(operator_file: Path | None = None) -> dict[str, Profile]:
    """The shipped profiles, overlaid by the operator's file (a profile there replaces or adds one)."""
    raw = read_tables("profiles", operator_file)
    return {name: _resolve(name, raw) for name in raw}


@dataclass(frozen=True)
class Folded:
    """A table of profiles.toml or presets.toml with its `extends` chain folded in: the flags and environment
    (a child's value wins, inherited flags first) and the tables themselves, root first."""

    flags: dict[str, Any]
    env: dict[str, str]
    chain: tuple[Mapping[str, Any], ...]

    def inherited(self, key: str, default: Any = None) -> Any:
        """The nearest table's value of a non-flag `key` (`default` when no table in the chain sets it)."""
        return next((table[key] for table in reversed(self.chain) if key in table), default)


def fold_extends(
    kind: str,
    name: str,
    raw: Mapping[str, Mapping[str, Any]],
    meta_keys: frozenset[str],
    flag_value: Callable[[str, str, Any], Any],
    seen: tuple[str, ...] = (),
) -> Folded:
    """Table `name` of `raw` (a `kind`: "profile" or "preset") over the tables it extends. Keys outside
    `meta_keys` are flags, each checked and converted by `flag_value(table name, key, value)` (which raises
    ProfileError)."""
    if name in seen:
        raise ProfileError(f"{kind} {name!r} extends itself through {' -> '.join(seen)}")
    table = raw[name]
    base = Folded({}, {}, ())
    if (parent := table.get("extends")) is not None:
        if parent not in raw:
            raise ProfileError(f"{kind} {name!r} extends unknown {kind} {parent!r}")
        base = fold_extends(kind, parent, raw, meta_keys, flag_value, (*seen, name))
    flags = dict(base.flags)
    flags.update({key: flag_value(name, key, value) for key, value in table.items() if key not in meta_keys})
    env = {**base.env, **{str(k): str(v) for k, v in dict(table.get("env", {})).items()}}
    return Folded(flags, env, (*base.chain, table))


def _flag_value(name: str, key: str, value: Any) -> Any:
    if key in _RESERVED_FLAGS:
        raise ProfileError(f"profile {name!r} sets --{key}; that comes from the engine settings")
    if not isinstance(value, str | int | float | bool):
        raise ProfileError(f"profile {name!r}: --{key} must be a string, number or boolean")
    return value


def _resolve(name: str, raw: Mapping[str, Mapping[str, Any]]) -> Profile:
    folded = fold_extends("profile", name, raw, _META_KEYS, _flag_value)
    table = raw[name]
    return Profile(
        name=name,
        description=str(table.get("description", "")),
        flags=folded.flags,
        env=folded.env,
        hidden=bool(table.get("hidden", False)),
    )


def select_profile(profiles: Mapping[str, Profile], name: str) -> Profile:
    """The named profile, or a ProfileError listing the choices."""
    profile = profiles.get(name)
    if profile is None or profile.hidden:
        choices = ", ".join(sorted(n for n, p in profiles.items() if not p.hidden))
        raise ProfileError(f"unknown engine profile {name!r}; choose one of: {choices}")
    return profile


def _flag_args(name: str, value: Any) -> list[str]:
    if value is True:
        return [f"--{name}"]
    if value is False:
        return []
    return [f"--{name}", str(value)]


def build_argv(launcher: Sequence[str], engine: EngineSettings, profile: Profile) -> list[str]:
    """The full `vllm serve` command line: launcher, model, bound to 127.0.0.1, profile flags, the operator's
    parallel sizes, extra args."""
    if not engine.model:
        raise ProfileError("no model configured: set NEMOTRON_ENGINE__MODEL (a model directory or hub id)")
    argv = [*launcher, "--model", engine.model, "--host", ENGINE_HOST, "--port", str(engine.port)]
    argv += ["--served-model-name", engine.served_model_name]
    for name, value in profile.flags.items():
        argv += _flag_args(name, value)
    # The operator's parallel sizes come after the profile's and preset's: vLLM takes the last of a flag.
    for name, size in (
        ("tensor-parallel-size", engine.tensor_parallel_size),
        ("data-parallel-size", engine.data_parallel_size),
    ):
        if size is not None:
            argv += [f"--{name}", str(size)]
    argv += list(engine.extra_args)
    return argv


def option_names(argv: Sequence[str]) -> list[str]:
    """The `--flag` names an argv uses (`--a=b` counted as `--a`)."""
    return [arg.split("=", 1)[0] for arg in argv if arg.startswith("--")]


def unknown_flags(argv: Sequence[str], accepted: frozenset[str]) -> list[str]:
    """Flags in `argv` the installed vLLM does not accept (`accepted` from its --help=all)."""
    return [name for name in option_names(argv) if name not in accepted]
