"""Our own running engine, as the supervisor's status file and /proc show it: its processes, the port it holds.

`doctor` run by hand next to a running stack finds the engine port taken and the GPU memory used, by the
engine it would start. The supervisor's status file names the engine's pid; the engine is that process and
every process below it. Only those processes' file descriptors are read, so a stranger's port is never
claimed (and no other user's /proc entries are needed). Linux only: elsewhere no engine is found.
Imports the engine package's status record only.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from gateway.engine.supervisor_state import read_status

_PROC = Path("/proc")
_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's `st` column


@dataclass(frozen=True)
class PortOwner:
    """The process of our stack that listens on the port, and the state its supervisor last wrote."""

    pid: int
    state: str


def listening_inodes(port: int, proc: Path = _PROC) -> set[int]:
    """The socket inodes listening on `port` (any address, IPv4 or IPv6)."""
    inodes: set[int] = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = (proc / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == _LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(int(fields[9]))
    return inodes


def _parents(proc: Path) -> dict[int, int]:
    """pid -> parent pid for every process visible in `proc`."""
    parents: dict[int, int] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # The command name (field 2) may hold spaces and parentheses: the fields after the last ')' are fixed.
        after = stat.rsplit(")", 1)[-1].split()
        if len(after) > 1 and after[1].isdigit():
            parents[int(entry.name)] = int(after[1])
    return parents


def descendants(roots: Iterable[int], proc: Path = _PROC) -> set[int]:
    """The `roots` that are alive and every process below them."""
    parents = _parents(proc)
    found = {pid for pid in roots if pid in parents}
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    stack = list(found)
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


def _holds(pid: int, sockets: set[str], proc: Path) -> bool:
    try:
        fds = list((proc / str(pid) / "fd").iterdir())
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(fd) in sockets:
                return True
        except OSError:
            continue
    return False


@dataclass(frozen=True)
class RunningEngine:
    """The engine the status file names, alive: its pid and every process below it, and the state last written."""

    pids: frozenset[int]
    state: str

    def port_owner(self, port: int, proc: Path = _PROC) -> PortOwner | None:
        """The engine's process that listens on `port`, if one does."""
        sockets = {f"socket:[{inode}]" for inode in listening_inodes(port, proc)}
        for pid in sorted(self.pids):
            if sockets and _holds(pid, sockets, proc):
                return PortOwner(pid, self.state)
        return None


def running_engine(status_file: Path, proc: Path = _PROC) -> RunningEngine | None:
    """Our engine, when the status file names one that is alive; else None."""
    status = read_status(status_file)
    if status is None or status.engine_pid is None:
        return None
    pids = descendants([status.engine_pid], proc)
    return RunningEngine(frozenset(pids), status.state.value) if pids else None
