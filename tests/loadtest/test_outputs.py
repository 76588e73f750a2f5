"""An open-loop `sweep` against the stub engine through vLLM's client: each point at its rate with its own seed;
results.json valid against its schema, report.md, PNG charts that open; `report` redraws them, `schema` prints the
schema and the schema rejects what it should; bad arguments exit 2."""

from __future__ import annotations

import contextlib
import copy
import io
import itertools
import json
from pathlib import Path
from typing import Any

import matplotlib.image
import pytest

from loadtest.charts import CHARTS
from loadtest.cli import main
from loadtest.schema import RESULTS_SCHEMA, SCHEMA_VERSION, validate

pytestmark = pytest.mark.timeout(300)  # each point starts vLLM's client: tens of seconds on a loaded machine

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
RATES = (25, 50)
DURATION_S = 4
TOKENS = 4


@pytest.fixture(scope="module")
def sweep(stub_url: str, demo_model: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """Two open-loop points (chat, no request bound: rate x duration arrivals each); the output dir and table."""
    out = tmp_path_factory.mktemp("sweep")
    argv = [
        "sweep", "--base-url", stub_url, "--tokenizer", demo_model, "--rate", ",".join(map(str, RATES)),
        "--duration", str(DURATION_S), "--warmup", "1", "--input-len", "16", "--max-tokens", str(TOKENS),
        "--ignore-eos", "--seed", "5", "--out", str(out),
    ]  # fmt: skip
    with contextlib.redirect_stdout(io.StringIO()) as table:
        assert main(argv) == 0
    return out, table.getvalue()


def _document(out: Path) -> dict[str, Any]:
    return dict(json.loads((out / "results.json").read_text()))


def test_each_point_sends_at_its_rate_with_its_own_seed(sweep: tuple[Path, str]) -> None:
    points = _document(sweep[0])["points"]
    assert [p["label"] for p in points] == ["rate=25/s", "rate=50/s"] and [p["seed"] for p in points] == [5, 6]
    normalised = []
    for point, rate in zip(points, RATES, strict=True):
        s = point["summary"]
        assert point["num_prompts"] == rate * DURATION_S == s["completed"] and s["failed"] == 0
        assert s["output_tokens"] == rate * DURATION_S * TOKENS, "the chat API's max_completion_tokens, ignore_eos"
        assert s["client_queue_time_ms"] is None, "no cap, no queue"
        starts = sorted(r["start_s"] for r in point["requests"])
        # Spread at the rate, not sent at once: a client on a busy machine can fall behind its schedule (a lower
        # rate), never get ahead of it.
        assert (len(starts) - 1) / starts[-1] <= 1.3 * rate
        normalised.append([(b - a) * rate for a, b in itertools.pairwise(starts)][:40])
    # One seed for both would give proportional arrival gaps: another seed per point, other arrivals (and prompts).
    differences = [abs(a - b) for a, b in zip(*normalised, strict=True)]
    assert sum(differences) / len(differences) > 0.2


def test_results_report_and_charts(sweep: tuple[Path, str]) -> None:
    out, table = sweep
    document = _document(out)
    assert validate(document) == [] and document["schema_version"] == SCHEMA_VERSION == 2
    assert document["kind"] == "sweep" and document["failures"] == {}
    assert document["client"]["program"] == "vllm bench serve" and document["client"]["version"]
    assert "| rate=25/s | 100 / 100 |" in table and "| rate=50/s | 200 / 200 |" in table
    assert all(p["telemetry"]["before"]["metrics"] is None for p in document["points"]), "the stub has no /metrics"
    for name in CHARTS:
        assert (out / name).read_bytes().startswith(PNG_SIGNATURE), name
        image = matplotlib.image.imread(out / name)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    report = (out / "report.md").read_text()
    assert "| point |" in report and all(f"]({name})" in report for name in CHARTS)
    assert sorted(path.name for path in (out / "vllm").glob("*.json")) == ["point-rate-25s.json", "point-rate-50s.json"]


def test_report_redraws_from_results_json(sweep: tuple[Path, str], tmp_path: Path) -> None:
    out = tmp_path / "copy"
    out.mkdir()
    (out / "results.json").write_bytes((sweep[0] / "results.json").read_bytes())
    assert main(["report", str(out)]) == 0
    assert all((out / name).read_bytes().startswith(PNG_SIGNATURE) for name in CHARTS)
    assert (out / "report.md").read_text() == (sweep[0] / "report.md").read_text()
    old = tmp_path / "old.json"
    old.write_text(json.dumps({**_document(out), "schema_version": 1}))
    assert main(["report", str(old)]) == 2


def test_the_schema_rejects_what_it_should(sweep: tuple[Path, str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schema"]) == 0
    assert json.loads(capsys.readouterr().out)["title"] == RESULTS_SCHEMA["title"]
    document = _document(sweep[0])
    breaks = {
        "$.schema_version": lambda d: d.update(schema_version=1),
        "$.points[0]": lambda d: d["points"][0].pop("client"),
        "$.points[0].summary.ttft_ms": lambda d: d["points"][0]["summary"]["ttft_ms"].update(p90="fast"),
        "$.points[1].requests[0].error": lambda d: d["points"][1]["requests"][0].update(error=3),
        "$.workload.prompts": lambda d: d["workload"]["prompts"].update(source="words"),
        "$.failures['c=1']": lambda d: d["failures"].update({"c=1": None}),
    }
    for path, damage in breaks.items():
        broken = copy.deepcopy(document)
        damage(broken)
        problems = validate(broken)
        assert problems and all(p.startswith(path) for p in problems), (path, problems)


def _exit_code(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse's own errors
        return int(exc.code or 0)


def test_bad_arguments_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = ["run", "--base-url", "http://127.0.0.1:9", "--model", "m", "--tokenizer", str(tmp_path)]
    lines = {
        "bad.jsonl": ('{"prompt": "fine", "output_tokens": 3}\n[1, 2]\n', "bad.jsonl:2: not a JSON object"),
        "chat.jsonl": ('{"messages": [{"role": "user", "content": "hi"}]}\n', 'needs a string "prompt"'),
        "short.jsonl": ('{"prompt": "no length"}\n', 'short.jsonl:1: needs "output_tokens"'),
        "prompts.json": ('{"prompt": "hi", "output_tokens": 3}\n', "only files named *.jsonl"),
    }
    for name, (text, message) in lines.items():
        (tmp_path / name).write_text(text)
        assert _exit_code([*run, "--prompts", str(tmp_path / name)]) == 2
        assert message in capsys.readouterr().err
    refusals = {
        "--max-concurrency and --burstiness shape an open loop": ["--concurrency", "2", "--max-concurrency", "4"],
        "--range-ratio must be in [0, 1)": ["--range-ratio", "1"],
        "--rate must be positive": ["--rate", "0"],
    }
    for message, flags in refusals.items():
        assert _exit_code([*run, *flags]) == 2
        assert message in capsys.readouterr().err
    assert _exit_code(["run", "--base-url", "http://127.0.0.1:9", "--model", "not-a-directory"]) == 2
    assert "--tokenizer is needed" in capsys.readouterr().err
    assert _exit_code([*run, "--max-tokens", "9:3"]) == 2  # one number now: --range-ratio spreads lengths
    assert _exit_code(["run", "--base-url", "http://127.0.0.1:9", "--no-metrics"]) == 2  # no /v1/models to ask
    assert _exit_code(["sweep", "--base-url", "http://127.0.0.1:9", "--model", "m", "--concurrency", "1,0"]) == 2
