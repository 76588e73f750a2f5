"""`nemotron-gateway doctor` run by hand next to a running stack: a real supervisor with the fake engine, the
settings it wrote to its state dir, and the doctor as a user runs it (a subprocess, no flags)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_supervisor import start_supervisor, status
from tests.procs import REPO_ROOT, free_port
from tests.unit.doctor.samples import write_model

pytestmark = pytest.mark.timeout(300)  # the hand-run doctor asks the installed vLLM (uncached: ~15-30 s)


def run_doctor_by_hand(state_dir: Path, tmp_path: Path) -> tuple[int, dict[str, dict[str, object]], str]:
    """The doctor from a plain shell: only the state dir is known (the default one in production)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEMOTRON_")}
    env.update({"NEMOTRON_ENGINE__STATE_DIR": str(state_dir), "HF_HUB_CACHE": str(tmp_path / "hf")})
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "doctor", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO_ROOT,
        check=False,
    )
    rows = {str(c["name"]): c for c in json.loads(result.stdout)["checks"]}
    return result.returncode, rows, result.stderr


def test_doctor_after_make_run_checks_the_running_stack(tmp_path: Path, redis_url: str) -> None:
    state_dir, port = tmp_path / "state", free_port()
    model = write_model(tmp_path / "model")
    # The supervisor writes the settings it runs with to <state_dir>/run.env itself.
    with start_supervisor(state_dir, port, NEMOTRON_ENGINE__MODEL=str(model), NEMOTRON_REDIS_URL=redis_url):
        assert (state_dir / "run.env").is_file()
        code, rows, err = run_doctor_by_hand(state_dir, tmp_path)
        engine_pid = status(state_dir)["engine_pid"]
    assert rows["engine port"]["status"] == "pass", rows["engine port"]
    assert rows["engine port"]["measured"] == f"127.0.0.1:{port} held by the running engine (pid {engine_pid}, ready)"
    assert rows["NVIDIA GPU"]["status"] != "fail"  # the CPU profile make run used, not the default balanced
    assert str(model) in str(rows["model directory"]["measured"])
    assert rows["Redis"]["status"] == "pass"
    assert code == 0, rows
    assert "run.env" in err


def test_doctor_still_reports_a_stranger_on_the_engine_port(tmp_path: Path, redis_url: str) -> None:
    # The state dir names an engine that runs elsewhere; the configured port is held by some other server.
    state_dir, port, elsewhere = tmp_path / "state", free_port(), free_port()
    model = write_model(tmp_path / "model")
    with start_supervisor(state_dir, elsewhere), start_supervisor(tmp_path / "other", port):
        (state_dir / "run.env").write_text(
            f"NEMOTRON_ENGINE__MODEL={model}\nNEMOTRON_ENGINE__PROFILE=cpu-dev\n"
            f"NEMOTRON_ENGINE__PORT={port}\nNEMOTRON_REDIS_URL={redis_url}\n"
        )
        code, rows, _ = run_doctor_by_hand(state_dir, tmp_path)
    assert rows["engine port"]["status"] == "fail" and rows["engine port"]["fatal"] is True
    assert code == 1
