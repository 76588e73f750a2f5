"""The result of one preflight check (`doctor`): status, what was measured, and the fix.

Imports only `rows` of ours; the check modules and the runner build on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

from gateway.doctor.rows import Row

NO_GPU = "skipped: no NVIDIA GPU"


class Status(StrEnum):
    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"


_SEVERITY = {Status.SKIP: 0, Status.PASS: 1, Status.WARN: 2, Status.FAIL: 3}


@dataclass(frozen=True)
class Check:
    """One row of the doctor's report.

    `fatal` (from the row) marks checks whose failure makes the supervisor refuse to spawn the engine; it says
    what kind of check this is, so a passing fatal check keeps `fatal=True`.
    """

    name: str
    status: Status
    measured: str
    fix: str = ""
    fatal: bool = False

    @property
    def blocks_start(self) -> bool:
        return self.fatal and self.status is Status.FAIL


def passed(row: Row, measured: str, fix: str = "") -> Check:
    return Check(row.name, Status.PASS, measured, fix, row.fatal)


def warned(row: Row, measured: str, fix: str) -> Check:
    return Check(row.name, Status.WARN, measured, fix, row.fatal)


def failed(row: Row, measured: str, fix: str) -> Check:
    return Check(row.name, Status.FAIL, measured, fix, row.fatal)


def skipped(row: Row, why: str) -> Check:
    return Check(row.name, Status.SKIP, why, "", row.fatal)


def worst(row: Row, checks: Sequence[Check], labels: Sequence[str]) -> Check:
    """One row for the same check run on several GPUs: the worst status, each GPU's reading labelled."""
    if len(checks) == 1:
        return replace(checks[0], name=row.name)
    top = max(checks, key=lambda c: _SEVERITY[c.status])
    measured = "; ".join(f"{label}: {c.measured}" for label, c in zip(labels, checks, strict=True))
    fixes = list(dict.fromkeys(c.fix for c in checks if c.fix and c.status is top.status))
    return Check(row.name, top.status, measured, " ".join(fixes), row.fatal)


def gib(n_bytes: float) -> str:
    """Bytes for a human: GiB with one decimal, MiB below 1 GiB."""
    if n_bytes < 2**30:
        return f"{n_bytes / 2**20:.1f} MiB"
    return f"{n_bytes / 2**30:.1f} GiB"
