"""`profiles` on the CPU tier: two operator profiles extending cpu-dev, each started through the supervisor on
the tiny demo model, measured by vLLM's benchmark client (the model path its tokenizer) and stopped; one row per
profile. The table's shape is what is checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest.cli import main
from loadtest.schema import validate
from tests.loadtest.conftest import CACHE_ROOT

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

PROFILES = """
[profiles.cpu-a]
extends = "cpu-dev"
description = "cpu-dev, at most 2 sequences in a batch"
max-num-seqs = 2

[profiles.cpu-b]
extends = "cpu-dev"
description = "cpu-dev, at most 8 sequences in a batch"
max-num-seqs = 8
"""


def test_profiles_give_one_row_per_profile(
    demo_model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(CACHE_ROOT / "vllm"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("NEMOTRON_ENGINE__RUN_DOCTOR", "false")  # asked in tests/engine/test_stack.py
    profiles_file = tmp_path / "profiles.toml"
    profiles_file.write_text(PROFILES)
    out = tmp_path / "out"
    code = main(
        [
            "profiles",
            "--profiles",
            "cpu-a,cpu-b",
            "--model-path",
            demo_model,
            "--profiles-file",
            str(profiles_file),
            "--state-dir",
            str(CACHE_ROOT / "loadtest-engine"),
            "--start-timeout",
            "240",
            *("--requests", "6", "--concurrency", "2", "--warmup", "1", "--max-tokens", "8", "--ignore-eos"),
            *("--input-len", "24", "--duration", "60", "--out", str(out)),
        ]
    )
    table = capsys.readouterr().out
    assert code == 0, table
    rows = [line for line in table.splitlines() if line.startswith("| cpu-")]
    assert [row.split(" | ")[0] for row in rows] == ["| cpu-a", "| cpu-b"]
    assert all(row.split(" | ")[4] == "n/a" for row in rows), "no GPU here: GPU memory reads n/a"
    document = json.loads((out / "results.json").read_text())
    assert validate(document) == [] and document["failures"] == {}
    assert document["target"]["via"] == "engine" and document["target"]["model"] == "nemotron"
    for point in document["points"]:
        summary = point["summary"]
        assert (summary["completed"], summary["failed"], summary["output_tokens"]) == (6, 0, 6 * 8)
        assert summary["ttft_ms"]["p50"] > 0 and summary["e2el_ms"]["p99"] >= summary["e2el_ms"]["p50"]
        assert point["client"]["cpu_s"] > 0 and point["seed"] == 0, "the same requests for every profile"
        # The engine's own counters, scraped before and after the point.
        delta = point["telemetry"]["metrics_delta"]
        assert sum(v for k, v in delta.items() if k.startswith("vllm:generation_tokens_total")) >= 6 * 8
    assert len({point["base_url"] for point in document["points"]}) == 2, "each profile's engine on its own port"
    report = (out / "report.md").read_text()
    assert "## Profiles" in report and "at each profile's own engine via engine" in report
