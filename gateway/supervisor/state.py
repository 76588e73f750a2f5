"""The supervisor's state machine and its status record (written to a file for `engine status`).

A leaf: imports nothing of ours.
"""

from __future__ import annotations

import enum
import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


class EngineState(enum.Enum):
    """STARTING -> READY <-> UNHEALTHY -> RESTARTING -> STARTING ...; STOPPING -> STOPPED | FAILED."""

    STARTING = "starting"
    READY = "ready"
    UNHEALTHY = "unhealthy"
    RESTARTING = "restarting"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"


@dataclass
class EngineStatus:
    """What `nemotron-gateway engine status` shows and the metrics export."""

    state: EngineState = EngineState.STARTING
    profile: str = ""
    model: str = ""
    engine_url: str = ""
    supervisor_pid: int = field(default_factory=os.getpid)
    engine_pid: int | None = None
    restarts: int = 0
    last_exit_code: int | None = None
    reason: str | None = None
    since: float = field(default_factory=time.time)
    started_at: float = field(default_factory=time.time)

    def to_json(self) -> dict[str, Any]:
        """The status as a JSON-ready dict."""
        data = asdict(self)
        data["state"] = self.state.value
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EngineStatus:
        """Read back what `to_json` wrote."""
        return cls(**{**data, "state": EngineState(data["state"])})

    def write(self, path: Path) -> None:
        """Write atomically (rename), so a reader never sees half a file."""
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".status-")
        with os.fdopen(fd, "w") as handle:
            json.dump(self.to_json(), handle)
        os.replace(tmp, path)


def read_status(path: Path) -> EngineStatus | None:
    """The last status a supervisor wrote, or None when there is none."""
    try:
        return EngineStatus.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, KeyError):
        return None
