"""`python -m gateway.supervisor.reaper --grace S -- CMD...`: the process-group leader around one command.

Runs CMD in its own (the reaper's) process group and tears the whole group down - SIGTERM, `grace`
seconds, SIGKILL, then the /dev/shm files the group held - when SIGTERM/SIGINT arrives, when CMD
exits (its orphaned helpers go too), or when stdin reaches EOF: the supervisor holds the only write end
of that pipe, so its death, SIGKILL included, reaches the reaper. While CMD runs it notes the inodes of
the /dev/shm files the group maps or holds open, because a file such as vLLM's `sem.mp-*` semaphores
may be let go long before the end, when only a resource tracker (killed with the group) still knows its
name. Exits with CMD's exit code.

Idle, it polls nothing: it sleeps in one select() on CMD's pidfd, its stdin, a signal wake-up pipe and an
inotify watch of /dev/shm, and reads /proc only when a file appears in /dev/shm (plus a slow safety scan).
Standard library and gateway.supervisor.process only: it must start fast and stay small.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import select
import signal
import subprocess
import sys
import time
from types import FrameType

from gateway.supervisor.process import group_members, shared_memory_inodes, terminate_group

_ORPHAN_GRACE = 2.0
# Seconds between two scans of the group's /dev/shm files when nothing wakes the reaper: a safety net for a
# missed inotify event (queue overflow) or a host without inotify; a scan of /proc costs a few ms.
_RESCAN_EVERY = 20.0
# Seconds at least between two scans that new /dev/shm files trigger: vLLM's start creates dozens, other
# processes on the host create theirs too; what the group creates it holds far longer than this.
MIN_SCAN_GAP = 1.0
# Without a pidfd (Linux < 5.3) the command's exit is looked for this often instead of waited on.
_POLL_WITHOUT_PIDFD = 0.1
_SHM_DIR = b"/dev/shm"
_IN_CREATE, _IN_MOVED_TO = 0x100, 0x80  # <sys/inotify.h>: a name appeared in the directory


def _watch_shm() -> int | None:
    """An inotify fd that becomes readable when a file is created in /dev/shm; None where inotify is missing.

    inotify is not in the standard library; libc's three calls through ctypes are. glibc's sem_open() links
    the semaphore to its final name after mapping it, and shm_open() returns the open fd, so the scan that an
    event triggers finds the new file held by its creator.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = int(libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC))
    except (OSError, AttributeError):
        return None
    if fd < 0:
        return None
    if libc.inotify_add_watch(fd, _SHM_DIR, _IN_CREATE | _IN_MOVED_TO) < 0:
        os.close(fd)
        return None
    return fd


def _read_some(fd: int) -> bytes | None:
    """One read from an fd select() found readable: b"" at EOF, None when a non-blocking fd had nothing after all."""
    try:
        return os.read(fd, 65536)
    except BlockingIOError:
        return None


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def main(argv: list[str] | None = None) -> int:
    """Run the guarded command; returns its exit code (128 + signal when the reaper ended it)."""
    parser = argparse.ArgumentParser(prog="gateway.supervisor.reaper")
    parser.add_argument("--grace", type=float, default=15.0)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given")
    stopped: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stopped.append(signum)

    # The handler only records; the wake-up pipe ends the select() it interrupted (PEP 475 would resume it).
    wake_read, wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    shm_watch = _watch_shm()
    child = subprocess.Popen(command, stdin=subprocess.DEVNULL)
    child_fd = _pidfd(child.pid)
    me = os.getpid()
    pgid = os.getpgid(me)
    seen = shared_memory_inodes(group_members(pgid, exclude=me))
    supervisor_gone = False
    waited = [fd for fd in (child_fd, wake_read, 0, shm_watch) if fd is not None]
    wait_at_most = _RESCAN_EVERY if child_fd is not None else _POLL_WITHOUT_PIDFD
    scanned_at = time.monotonic()
    scan_at = scanned_at + _RESCAN_EVERY
    while child.poll() is None and not stopped and not supervisor_gone:
        timeout = min(wait_at_most, max(0.0, scan_at - time.monotonic()))
        ready, _, _ = select.select(waited, [], [], timeout)
        supervisor_gone = 0 in ready and _read_some(0) == b""
        if wake_read in ready:
            _read_some(wake_read)
        if shm_watch is not None and shm_watch in ready and _read_some(shm_watch) is not None:
            scan_at = min(scan_at, scanned_at + MIN_SCAN_GAP)
        if time.monotonic() >= scan_at:
            seen |= shared_memory_inodes(group_members(pgid, exclude=me))
            scanned_at = time.monotonic()
            scan_at = scanned_at + _RESCAN_EVERY
    # When the command ended by itself, what is left are its orphaned helpers: no need to wait long.
    asked = bool(stopped) or supervisor_gone
    grace = args.grace if asked else min(args.grace, _ORPHAN_GRACE)
    terminate_group(pgid, grace, exclude=me, seen=seen)
    code = child.wait()
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
