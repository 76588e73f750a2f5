"""The result of one preflight check (`doctor`): status, what was measured, and the fix.

Imports nothing of ours; the check modules and `doctor.py` build on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

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

    `fatal` marks checks whose failure makes the supervisor refuse to spawn the engine; it says what kind of
    check this is, so a passing fatal check keeps `fatal=True`.
    """

    name: str
    status: Status
    measured: str
    fix: str = ""
    fatal: bool = False

    @property
    def blocks_start(self) -> bool:
        return self.fatal and self.status is Status.FAIL


def passed(name: str, measured: str, fix: str = "", *, fatal: bool = False) -> Check:
    return Check(name, Status.PASS, measured, fix, fatal)


def warned(name: str, measured: str, fix: str, *, fatal: bool = False) -> Check:
    return Check(name, Status.WARN, measured, fix, fatal)


def failed(name: str, measured: str, fix: str, *, fatal: bool = False) -> Check:
    return Check(name, Status.FAIL, measured, fix, fatal)


def skipped(name: str, why: str, *, fatal: bool = False) -> Check:
    return Check(name, Status.SKIP, why, "", fatal)


def worst(name: str, checks: Sequence[Check], labels: Sequence[str]) -> Check:
    """One row for the same check run on several GPUs: the worst status, each GPU's reading labelled."""
    if len(checks) == 1:
        return replace(checks[0], name=name)
    top = max(checks, key=lambda c: _SEVERITY[c.status])
    measured = "; ".join(f"{label}: {c.measured}" for label, c in zip(labels, checks, strict=True))
    fixes = list(dict.fromkeys(c.fix for c in checks if c.fix and c.status is top.status))
    return Check(name, top.status, measured, " ".join(fixes), top.fatal)


def gib(n_bytes: float) -> str:
    """Bytes for a human: GiB with one decimal, MiB below 1 GiB."""
    if n_bytes < 2**30:
        return f"{n_bytes / 2**20:.1f} MiB"
    return f"{n_bytes / 2**30:.1f} GiB"
