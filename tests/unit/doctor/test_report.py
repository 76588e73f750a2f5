"""The report: table alignment, fatal marks, JSON, exit code."""

from __future__ import annotations

import json

import pytest

from gateway.doctor import rows
from gateway.doctor.check import failed, passed, warned
from gateway.doctor.report import exit_code, fatal_failures, render_json, render_table

pytestmark = pytest.mark.timeout(30)


SAMPLE = [
    passed(rows.GPU_PRESENT, "1 x NVIDIA H200; driver 580.159.04"),
    warned(rows.OPEN_FILES, "20000", "LimitNOFILE=65536 in the systemd unit " * 3),
    failed(rows.ENGINE_PORT, "127.0.0.1:8001 in use (Address already in use)", "stop it"),
    failed(rows.REDIS, "redis://127.0.0.1:1/0: refused", "start Redis"),
]


def test_render_table_aligns_columns_and_marks_fatal() -> None:
    lines = render_table(SAMPLE).splitlines()
    header = lines[0]
    measured_at, fix_at = header.index("MEASURED"), header.index("FIX")
    rows = [line for line in lines[1:] if line and not line[0].isspace() and not line[0].isdigit()]
    assert [r.split()[0] for r in rows] == ["PASS", "WARN", "FAIL*", "FAIL"]
    for row, check in zip(rows, SAMPLE, strict=True):
        assert row[measured_at:].startswith(check.measured[:20])
        if check.fix:
            assert row[fix_at:].startswith(check.fix[:10])
    assert any(line.startswith(" ") and line[fix_at:].strip() for line in lines)  # the long fix wraps
    assert lines[-1] == "1 pass, 1 warn, 2 fail, 0 skip; * fatal: the supervisor will not start the engine (1)"


def test_render_json_and_exit_code() -> None:
    body = json.loads(render_json(SAMPLE))
    assert body["exit_code"] == 1 and body["fatal_failures"] == ["engine port"]
    assert body["checks"][1] == {
        "name": "open files (ulimit -n)",
        "status": "warn",
        "measured": "20000",
        "fix": SAMPLE[1].fix,
        "fatal": False,
    }
    assert exit_code(SAMPLE[:2]) == 0 and exit_code(SAMPLE[3:]) == 1
    assert fatal_failures(SAMPLE) == [SAMPLE[2]]
