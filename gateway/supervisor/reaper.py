"""`python -m gateway.supervisor.reaper --grace S -- CMD...`: the process-group leader around one command.

Runs CMD in its own (the reaper's) process group and tears the whole group down - SIGTERM, `grace`
seconds, SIGKILL, then the /dev/shm files the group held - when SIGTERM/SIGINT arrives, when CMD
exits (its orphaned helpers go too), or when stdin reaches EOF: the supervisor holds the only write end
of that pipe, so its death, SIGKILL included, reaches the reaper. While CMD runs it samples the inodes of
the /dev/shm files the group maps or holds open, because a file such as vLLM's `sem.mp-*` semaphores
may be let go long before the end, when only a resource tracker (killed with the group) still knows its
name (issue 12). Exits with CMD's exit code.
Standard library and gateway.supervisor.process only: it must start fast and stay small.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from types import FrameType

from gateway.supervisor.process import group_members, shared_memory_inodes, terminate_group

_ORPHAN_GRACE = 2.0
# Seconds between two samples of the group's /dev/shm files: a scan of /proc costs a few ms.
_SAMPLE_EVERY = 0.5
# Seconds between two looks at the command: its exit reaches the supervisor this late at most.
_POLL = 0.1


def _watch_stdin(gone: threading.Event) -> None:
    while os.read(0, 4096):
        pass
    gone.set()


def main(argv: list[str] | None = None) -> int:
    """Run the guarded command; returns its exit code (128 + signal when the reaper ended it)."""
    parser = argparse.ArgumentParser(prog="gateway.supervisor.reaper")
    parser.add_argument("--grace", type=float, default=15.0)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given")
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    child = subprocess.Popen(command, stdin=subprocess.DEVNULL)
    threading.Thread(target=_watch_stdin, args=(stop,), daemon=True).start()
    me = os.getpid()
    pgid = os.getpgid(me)
    seen: set[int] = set()
    next_sample = 0.0
    while child.poll() is None and not stop.is_set():
        if time.monotonic() >= next_sample:
            seen |= shared_memory_inodes(group_members(pgid, exclude=me))
            next_sample = time.monotonic() + _SAMPLE_EVERY
        stop.wait(_POLL)
    # When the command ended by itself, what is left are its orphaned helpers: no need to wait long.
    grace = args.grace if stop.is_set() else min(args.grace, _ORPHAN_GRACE)
    terminate_group(pgid, grace, exclude=me, seen=seen)
    code = child.wait()
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
