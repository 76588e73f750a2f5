"""The newest vLLM release the project checks (0.33.0), really installed in a venv of its own
(scripts/install-vllm-check): every preset with every profile, as the supervisor would launch it there, passes vLLM's
own argument parser and the checks `vllm serve` makes before it loads a model; the project's plugin loads through
vLLM's plugin loader and its tool parser works; and the flag list the gateway ships for that release is what its
`--help=all` says.

No engine starts: the release has no CPU build, and its CUDA wheel runs here only as far as its Python goes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gateway.engine.launch import installed_vllm, prepare, shipped_flag_list
from gateway.engine.presets import load_presets
from gateway.engine.profiles import ProfileError, load_profiles
from gateway.settings import Settings
from tests.procs import REPO_ROOT

VERSION = "0.33.0"
VENV = REPO_ROOT / ".cache" / f"vllm-{VERSION}"
PROBE = Path(__file__).with_name("vllm_probe.py")
# The CUDA wheel finds no GPU here: this makes vLLM take the CPU platform instead of failing to pick one.
VLLM_ENV = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"}
# Flags 0.33.0 refuses, each a control that the parse below can fail at all.
REFUSED = {
    "--no-such-flag": ["--no-such-flag"],
    "unknown tool parser": ["--enable-auto-tool-choice", "--tool-call-parser", "no_such_parser"],
    "unknown reasoning parser": ["--reasoning-parser", "no_such_parser"],
}

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def python() -> str:
    """The interpreter of the venv with vLLM 0.33.0 and this project's plugin (installed on first use, ~1.5 min
    from a fresh clone; scripts/test installs it beforehand, in the background)."""
    installed = subprocess.run(
        [str(REPO_ROOT / "scripts" / "install-vllm-check"), str(VENV)],
        capture_output=True,
        text=True,
        timeout=840,
        check=False,
    )
    assert installed.returncode == 0, installed.stdout[-2000:] + installed.stderr[-3000:]
    return str(VENV / "bin" / "python")


def launch_flags(python: str, preset: str, profile: str, state_dir: Path) -> tuple[list[str], list[str]]:
    """(launcher, flags): the supervisor's command line for `preset` with `profile` on the venv's vLLM, split where
    vLLM's own parser starts reading. prepare() itself refuses a flag missing from the release's shipped flag list.
    The model is a local folder (vLLM's engine arguments look a hub id up, and the probe runs offline)."""
    engine = {"model": str(state_dir), "preset": preset, "profile": profile, "python": python}
    _, argv, _ = prepare(Settings(engine={**engine, "state_dir": str(state_dir)}))
    model = argv.index("--model")
    return argv[:model], argv[model:]


COMBOS = [
    (preset, profile)
    for preset in sorted(load_presets())
    for profile, spec in sorted(load_profiles().items())
    if not spec.hidden
]


@pytest.fixture(scope="module")
def launched(python: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every combination's launcher and flags, and the probe's answer for them and for the controls (one vLLM
    import: ~15 s of a core)."""
    state_dir = tmp_path_factory.mktemp("state")
    launchers, argvs, unlisted = set(), [], {}
    for preset, profile in COMBOS:
        try:
            start, flags = launch_flags(python, preset, profile, state_dir)
        except ProfileError as exc:
            unlisted[f"{preset} + {profile}"] = str(exc)
            start, flags = [], []
        launchers.add(tuple(start[1:]))
        argvs.append(flags)
    controls = [[*argvs[0], *flags] for flags in REFUSED.values()]
    answer = probe(python, [*argvs, *controls], state_dir)
    return {"launchers": launchers, "unlisted": unlisted, **answer}


def test_every_preset_with_every_profile_passes_vllms_own_parser(python: str, launched: dict[str, Any]) -> None:
    version, launcher = installed_vllm(python)
    assert version == f"vllm-{VERSION}"
    assert launched["unlisted"] == {}, f"the gateway refuses these on vLLM {VERSION}: {launched['unlisted']}"
    # Both ways the supervisor starts this (GPU) build: the api_server module, and `vllm serve` for several API
    # servers (the throughput profiles); both parse with vLLM's make_arg_parser.
    assert launched["launchers"] == {tuple(launcher[1:]), ("-m", "vllm.entrypoints.cli.main", "serve")}
    verdicts = zip(COMBOS, launched["argvs"][: len(COMBOS)], strict=True)
    refused = {f"{preset} + {profile}": verdict for (preset, profile), verdict in verdicts if verdict}
    assert refused == {}, f"vLLM {VERSION} refuses these command lines: {json.dumps(refused, indent=1)}"
    for name, verdict in zip(REFUSED, launched["argvs"][len(COMBOS) :], strict=True):
        assert verdict, f"vLLM {VERSION} took a command line with {name}: the probe checks nothing"


def test_the_plugin_loads_through_vllms_loader_and_its_tool_parser_works(launched: dict[str, Any]) -> None:
    plugins = launched["plugins"]
    assert plugins["registered"], f"nemotron_json is not among vLLM {VERSION}'s tool parsers after its plugin loader"
    assert plugins["class"] == "engine_patches.toolcall.NemotronJsonToolParser"
    assert plugins["calls"] == [["get_weather", {"city": "Paris"}]]


def test_the_shipped_flag_list_of_the_release_is_its_help(python: str, tmp_path: Path) -> None:
    shipped = shipped_flag_list(f"vllm-{VERSION}")
    assert shipped is not None, f"no shipped flag list for vllm-{VERSION}: run `python -m tools.vllm_flags --python`"
    written = subprocess.run(
        [sys.executable, "-m", "tools.vllm_flags", "--python", python, "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO_ROOT,
        env=VLLM_ENV,
        check=False,
    )
    assert written.returncode == 0, written.stderr[-2000:]
    read = frozenset((tmp_path / f"vllm-{VERSION}.txt").read_text().split())
    assert shipped == read, (
        f"the shipped list of vllm-{VERSION} differs from its --help=all: not shipped {sorted(read - shipped)}, "
        f"shipped but gone {sorted(shipped - read)}"
    )


def probe(python: str, argvs: list[list[str]], tmp_path: Path) -> dict[str, Any]:
    """tests/integration/vllm_probe.py's answer for `argvs`, run by the venv's interpreter."""
    out = tmp_path / "probe.json"
    ran = subprocess.run(
        [python, str(PROBE), str(out)],
        input=json.dumps({"argvs": argvs}),
        capture_output=True,
        text=True,
        timeout=300,
        env=VLLM_ENV,
        check=False,
    )
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-3000:]
    answer: dict[str, Any] = json.loads(out.read_text())
    return answer
