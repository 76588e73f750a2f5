"""What the checks add up to: the fatal failures, the exit code, and the report as a table or JSON.

Imports only `check` of ours.
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Sequence
from dataclasses import asdict

from gateway.doctor.check import Check, Status

_COLUMN = 56  # measured and fix wrap at this width in the table


def fatal_failures(checks: Sequence[Check]) -> list[Check]:
    """The failures that make the supervisor refuse to spawn the engine."""
    return [c for c in checks if c.blocks_start]


def exit_code(checks: Sequence[Check]) -> int:
    """1 if any check failed (fatal or not), else 0: warnings do not fail the doctor."""
    return int(any(c.status is Status.FAIL for c in checks))


def _cell(text: str, width: int) -> list[str]:
    return textwrap.wrap(text, width, break_on_hyphens=False) or [""]


def render_table(checks: Sequence[Check]) -> str:
    """Aligned columns STATUS, CHECK, MEASURED, FIX (long cells wrap); fatal failures marked `FAIL*`."""
    labels = [c.status.value.upper() + ("*" if c.blocks_start else "") for c in checks]
    name_width = max([len("CHECK"), *(len(c.name) for c in checks)])
    measured_width = min(_COLUMN, max([len("MEASURED"), *(len(c.measured) for c in checks)]))
    lines = [f"{'STATUS':<6}  {'CHECK':<{name_width}}  {'MEASURED':<{measured_width}}  FIX"]
    for label, check in zip(labels, checks, strict=True):
        measured, fix = _cell(check.measured, measured_width), _cell(check.fix, _COLUMN)
        for i in range(max(len(measured), len(fix))):
            row = [
                label if i == 0 else "",
                check.name if i == 0 else "",
                measured[i] if i < len(measured) else "",
            ]
            text = f"{row[0]:<6}  {row[1]:<{name_width}}  {row[2]:<{measured_width}}  {fix[i] if i < len(fix) else ''}"
            lines.append(text.rstrip())
    counts = {s: sum(c.status is s for c in checks) for s in Status}
    summary = ", ".join(f"{counts[s]} {s.value}" for s in Status)
    fatal = fatal_failures(checks)
    lines.append("")
    lines.append(summary + (f"; * fatal: the supervisor will not start the engine ({len(fatal)})" if fatal else ""))
    return "\n".join(lines) + "\n"


def render_json(checks: Sequence[Check]) -> str:
    """{"exit_code", "fatal_failures": [names], "checks": [{name, status, measured, fix, fatal}]}."""
    body = {
        "exit_code": exit_code(checks),
        "fatal_failures": [c.name for c in fatal_failures(checks)],
        "checks": [{**asdict(c), "status": c.status.value} for c in checks],
    }
    return json.dumps(body, indent=2) + "\n"
