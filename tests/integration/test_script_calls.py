"""`python -m tools.script_calls` against the test Redis: both trees measured in the same rounds, each in a
process importing its own `gateway` package, and the table names what a reader compares."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from loadtest.processes import REPO_ROOT
from tools import script_calls

pytestmark = pytest.mark.timeout(120)


def test_a_baseline_tree_is_measured_beside_this_one(redis_clean: str, tmp_path: Path) -> None:
    base = tmp_path / "base"
    base.mkdir()
    archive = subprocess.run(["git", "archive", "HEAD", "gateway"], cwd=REPO_ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(base)], input=archive.stdout, check=True)
    out = tmp_path / "calls.json"
    assert (
        script_calls.main(
            ["--redis-url", redis_clean, "--calls", "64", "--rounds", "2", "--baseline", str(base), "--json", str(out)]
        )
        == 0
    )
    summary = json.loads(out.read_text())
    assert set(summary) == {"this tree", "baseline"}
    for levels in summary.values():
        assert set(levels) == {"c=1", "c=32"}
        for figures in levels.values():
            assert figures["calls_per_s"] > 0 and figures["cpu_us_per_call"] > 0


def test_a_baseline_without_a_gateway_package_is_refused_not_replaced_by_this_tree(
    redis_clean: str, tmp_path: Path
) -> None:
    with pytest.raises(SystemExit, match="holds no gateway package"):
        script_calls.main(
            ["--redis-url", redis_clean, "--calls", "8", "--rounds", "1", "--baseline", str(tmp_path / "empty")]
        )
