"""Whether a listening TCP port belongs to our own running engine, read from /proc and the supervisor's status.

`doctor` run by hand next to a running stack finds the engine port taken, by the engine it would start. The
supervisor's status file names the engine's pid; the port is ours when the process listening on it is that
process or one of its descendants. Only those processes' file descriptors are read, so a stranger's port is
never claimed (and no other user's /proc entries are needed). Linux only: elsewhere nothing is ours.
Imports the supervisor's status record only.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from gateway.supervisor.state import read_status

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


def engine_owner(port: int, status_file: Path, proc: Path = _PROC) -> PortOwner | None:
    """Our engine (the pid the status file names, or a process below it) when it listens on `port`, else None."""
    status = read_status(status_file)
    if status is None or status.engine_pid is None:
        return None
    inodes = listening_inodes(port, proc)
    sockets = {f"socket:[{inode}]" for inode in inodes}
    for pid in sorted(descendants([status.engine_pid], proc)):
        if _holds(pid, sockets, proc):
            return PortOwner(pid, status.state.value)
    return None
