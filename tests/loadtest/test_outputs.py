"""The command line's outputs against the stub engine: results.json valid against its schema, report.md, PNG
charts that open; `report` redraws them, `schema` prints the schema."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib.image
import pytest

from loadtest.charts import CHARTS
from loadtest.cli import main
from loadtest.schema import RESULTS_SCHEMA, SCHEMA_VERSION, validate

pytestmark = pytest.mark.timeout(30)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
WORKLOAD = [
    "--requests",
    "12",
    "--duration",
    "10",
    "--warmup",
    "1",
    "--max-tokens",
    "4:8",
    "--prompt-tokens-mean",
    "16",
]


def _check_outputs(out: Path) -> dict[str, Any]:
    document = json.loads((out / "results.json").read_text())
    assert validate(document) == []
    assert document["schema_version"] == SCHEMA_VERSION
    for name in CHARTS:
        data = (out / name).read_bytes()
        assert data.startswith(PNG_SIGNATURE), name
        image = matplotlib.image.imread(out / name)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    report = (out / "report.md").read_text()
    assert "| point |" in report and all(f"]({name})" in report for name in CHARTS)
    return dict(document)


def test_run_writes_results_report_and_charts(
    stub_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    code = main(["run", "--base-url", stub_url + "/v1", "--concurrency", "3", *WORKLOAD, "--slo-ttft", "500"])
    assert code == 0 and "| c=3 | 12 / 12 |" in capsys.readouterr().out
    code = main(["run", "--base-url", stub_url, "--concurrency", "3", *WORKLOAD, "--out", str(out), "--quiet"])
    assert code == 0
    document = _check_outputs(out)
    assert len(document["points"]) == 1
    point = document["points"][0]
    assert point["concurrency"] == 3 and point["summary"]["ok"] == 12 and len(point["requests"]) == 12
    assert point["telemetry"]["before"]["metrics"] is None  # the stub has no /metrics
    assert document["target"] == {"base_url": stub_url, "model": "bench-model", "via": None}


def test_sweep_has_one_point_per_level_and_report_redraws(stub_url: str, tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    argv = ["sweep", "--base-url", stub_url, "--concurrency", "1,2,4", *WORKLOAD, "--out", str(out), "--quiet"]
    assert main(argv) == 0
    document = _check_outputs(out)
    assert [p["label"] for p in document["points"]] == ["c=1", "c=2", "c=4"]
    # Each point gets fresh prompts: no request body repeats across points.
    indices = [r["index"] for p in document["points"] for r in p["requests"]]
    assert len(set(indices)) == len(indices) == 36
    for name in CHARTS:
        (out / name).unlink()
    assert main(["report", str(out)]) == 0
    _check_outputs(out)


def test_open_loop_sweep_and_non_stream(stub_url: str, tmp_path: Path) -> None:
    out = tmp_path / "rates"
    argv = ["sweep", "--base-url", stub_url, "--rate", "20,40", "--duration", "0.5", "--requests", "100"]
    assert main([*argv, "--no-stream", "--endpoint", "completions", "--warmup", "0", "--out", str(out)]) == 0
    document = _check_outputs(out)
    points = document["points"]
    assert [p["rate"] for p in points] == [20.0, 40.0]
    assert all(p["summary"]["ttft_ms"]["count"] == 0 and p["summary"]["ok"] > 0 for p in points)


def test_the_schema_rejects_what_it_should(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schema"]) == 0
    assert json.loads(capsys.readouterr().out)["title"] == RESULTS_SCHEMA["title"]
    assert validate({"schema_version": 1}) != []
    problems = validate({"schema_version": 99, "kind": "run", "points": [{"label": 3}]})
    assert any("99" in p for p in problems) and any("$.points[0].label" in p for p in problems)
    assert any("'summary' is a required property" in p for p in problems)


def test_bad_arguments_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "prompts.jsonl"
    bad.write_text('{"prompt": "fine"}\n[1, 2]\n')
    argv = ["run", "--base-url", "http://127.0.0.1:9", "--model", "m", "--prompts", str(bad)]
    assert main(argv) == 2
    assert "prompts.jsonl:2: not a JSON object" in capsys.readouterr().err
    assert main(["run", "--base-url", "http://127.0.0.1:9", "--model", "m", "--max-tokens", "9:3"]) == 2
    assert main(["run", "--base-url", "http://127.0.0.1:9", "--no-metrics"]) == 2  # no /v1/models to ask
