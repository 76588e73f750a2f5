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

STATUS_FILE = "engine.json"
# The settings a supervisor runs with, as an env file in its state dir (a hand-run `doctor` reads it).
RUNNING_ENV = "run.env"
# An operator's request that the supervisor restart its engine (`nemotron-gateway replicas restart`): a file in the
# replica's state dir, which its supervisor polls (within `RESTART_REQUEST_POLL` s) and removes when it acts on it.
# A file rather than a signal: several replicas' supervisors may share one process (`up`).
RESTART_REQUEST = "restart.request"
RESTART_REQUEST_POLL = 0.25
# vLLM's --scheduling-policy values (vllm/config/scheduler.py, SchedulerPolicy) and its default.
FCFS = "fcfs"
PRIORITY = "priority"
_POLICY_FLAG = "--scheduling-policy"
# vLLM's bound on sequences running at once, per data-parallel rank: admission keeps
# `NEMOTRON_ADMISSION__RESERVED_SEQS` of them for the most urgent tier.
_MAX_NUM_SEQS_FLAG = "--max-num-seqs"
DATA_PARALLEL_FLAG = "--data-parallel-size"
TENSOR_PARALLEL_FLAG = "--tensor-parallel-size"
# Restarts kept in the status file: enough to tell a crash loop from one hang, short enough to read.
HISTORY_LENGTH = 5


class EngineState(enum.Enum):
    """STARTING -> READY <-> UNHEALTHY -> RESTARTING -> STARTING ...; STOPPING -> STOPPED | FAILED."""

    STARTING = "starting"
    READY = "ready"
    UNHEALTHY = "unhealthy"
    RESTARTING = "restarting"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"


class RestartCause(enum.Enum):
    """Why an engine life ended without a stop being asked for."""

    CRASH = "crash"  # the process exited by itself
    START_FAILED = "start failed"  # exited, or never became ready, during start-up
    NOT_GENERATING = "not generating"  # answers, but produced no token within the stall bound
    UNRESPONSIVE = "unresponsive"  # no answer at all (refused or timed out) within the stall bound
    REQUESTED = "requested"  # an operator's restart request: no crash, counted in no crash budget


@dataclass
class RestartRecord:
    """One engine life that ended unasked: when, why, and the exit code when it exited by itself."""

    at: float
    cause: RestartCause
    reason: str
    exit_code: int | None = None

    def to_json(self) -> dict[str, Any]:
        """The record as a JSON-ready dict."""
        return {**asdict(self), "cause": self.cause.value}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RestartRecord:
        """Read back what `to_json` wrote."""
        return cls(**{**data, "cause": RestartCause(data["cause"])})


@dataclass
class EngineStatus:
    """What `nemotron-gateway engine status` shows and the metrics export.

    `engine_pid` is vLLM's own process (the API server); `group_pid` is its guard, the leader of the
    process group that holds vLLM and every helper it forks.
    """

    state: EngineState = EngineState.STARTING
    profile: str = ""
    model: str = ""
    engine_url: str = ""
    supervisor_pid: int = field(default_factory=os.getpid)
    engine_pid: int | None = None
    group_pid: int | None = None
    restarts: int = 0
    last_exit_code: int | None = None
    reason: str | None = None
    since: float = field(default_factory=time.time)
    started_at: float = field(default_factory=time.time)
    history: list[RestartRecord] = field(default_factory=list)
    # The --scheduling-policy of the argv launched: the gateway sends `priority` only to a "priority" engine.
    scheduling_policy: str = FCFS
    # Sequences the launched engine runs at once (None: vLLM's own default, which depends on the GPU).
    sequence_slots: int | None = None
    # The engine's processes when last looked at (vLLM, its EngineCore, a worker per GPU, ...), each watched.
    processes: list[int] = field(default_factory=list)
    # The GPUs it was given (its CUDA_VISIBLE_DEVICES; None: every GPU) and its parallel sizes.
    gpus: str | None = None
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1

    def record_restart(self, record: RestartRecord) -> None:
        """Remember why a life ended (the last `HISTORY_LENGTH` only)."""
        self.history = [*self.history, record][-HISTORY_LENGTH:]

    def to_json(self) -> dict[str, Any]:
        """The status as a JSON-ready dict."""
        data = asdict(self)
        data["state"] = self.state.value
        data["history"] = [record.to_json() for record in self.history]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EngineStatus:
        """Read back what `to_json` wrote."""
        history = [RestartRecord.from_json(item) for item in data.get("history", [])]
        return cls(**{**data, "state": EngineState(data["state"]), "history": history})

    def write(self, path: Path) -> None:
        """Write atomically (rename), so a reader never sees half a file."""
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".status-")
        with os.fdopen(fd, "w") as handle:
            json.dump(self.to_json(), handle)
        os.replace(tmp, path)


def flag_value(argv: list[str], flag: str) -> str | None:
    """The value an engine argv gives `flag` (`--flag V` or `--flag=V`; the last one wins, as with argparse)."""
    value = None
    for index, arg in enumerate(argv):
        if arg == flag and index + 1 < len(argv):
            value = argv[index + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def parallel_size(argv: list[str], flag: str) -> int:
    """A parallel size an engine argv sets (`--tensor-parallel-size`, `--data-parallel-size`), else vLLM's 1."""
    value = flag_value(argv, flag) or "1"
    return int(value) if value.isdigit() else 1


def scheduling_policy(argv: list[str]) -> str:
    """The --scheduling-policy an engine argv sets, else vLLM's "fcfs"."""
    return flag_value(argv, _POLICY_FLAG) or FCFS


def sequence_slots(argv: list[str]) -> int | None:
    """Sequences an engine launched with `argv` runs at once: its --max-num-seqs on each of its
    --data-parallel-size ranks; None when the argv sets no --max-num-seqs (vLLM's default depends on the GPU)."""
    per_rank = flag_value(argv, _MAX_NUM_SEQS_FLAG)
    if per_rank is None or not per_rank.isdigit():
        return None
    return int(per_rank) * parallel_size(argv, DATA_PARALLEL_FLAG)


def launched_policy(path: Path) -> str:
    """The scheduling policy of the engine the supervisor whose status file is `path` launched; "fcfs" (never send
    `priority`) when there is no such file: an engine the gateway cannot see launched may refuse it."""
    status = read_status(path)
    return status.scheduling_policy if status is not None else FCFS


def launched_sequence_slots(path: Path) -> int | None:
    """The sequence slots of the engine the supervisor whose status file is `path` launched; None when unknown."""
    status = read_status(path)
    return status.sequence_slots if status is not None else None


def read_status(path: Path) -> EngineStatus | None:
    """The last status a supervisor wrote, or None when there is none."""
    try:
        return EngineStatus.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, KeyError):
        return None


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (ours or not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def request_restart(state_dir: Path) -> Path:
    """Ask the supervisor of `state_dir` to restart its engine (a ready or unhealthy one, within about
    `RESTART_REQUEST_POLL` s; an engine starting when the request is made is restarted once it is ready). Returns the
    request file, which the supervisor removes when it acts."""
    path = state_dir / RESTART_REQUEST
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".restart-")
    with os.fdopen(fd, "w") as handle:
        handle.write(f"{time.time()!r}\n")
    os.replace(tmp, path)
    return path


def take_restart_request(state_dir: Path) -> bool:
    """Remove a restart request from `state_dir`; whether there was one."""
    try:
        (state_dir / RESTART_REQUEST).unlink()
    except FileNotFoundError:
        return False
    return True
