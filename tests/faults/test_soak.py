"""A 20-second `make soak`: the gateway's RSS and open fds stay flat under mixed traffic with keys on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.faults.conftest import Figures
from tests.procs import REPO_ROOT

pytestmark = [pytest.mark.faults, pytest.mark.timeout(120)]


def test_short_soak_stays_flat(redis_url: str, tmp_path: Path, figures: Figures) -> None:
    report_path, summary_path = tmp_path / "soak.json", tmp_path / "soak.md"
    argv = [sys.executable, "-m", "loadtest.soak", "--duration", "20", "--warmup", "5", "--interval", "1"]
    argv += [
        "--concurrency",
        "4",
        "--redis-url",
        redis_url,
        "--json",
        str(report_path),
        "--markdown",
        str(summary_path),
    ]
    done = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=100, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(report_path.read_text())
    verdict = report["verdict"]
    assert verdict["passed"] and verdict["errors"] == 0, verdict
    assert len(report["samples"]) >= 15, "RSS and fds were sampled every second"
    assert report["tally"]["streams"] > 0 and report["tally"]["abandoned"] > 0
    assert "# Soak: passed" in summary_path.read_text()
    figures("soak_20s.rss_growth_mb", verdict["rss_growth_mb"], "MB", "after a 5 s warm-up, 4 clients")
    figures("soak_20s.fd_growth", verdict["fd_growth"], "fds")
