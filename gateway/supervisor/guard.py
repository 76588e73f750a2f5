"""`python -m gateway.supervisor.guard --grace S -- CMD...`: the process-group leader around one command.

Runs CMD in its own (the guard's) process group and tears the whole group down — SIGTERM, `grace`
seconds, SIGKILL, then the /dev/shm files the group held — when SIGTERM/SIGINT arrives, when CMD
exits (its orphaned helpers go too), or when stdin reaches EOF: the supervisor holds the only write end
of that pipe, so its death, SIGKILL included, reaches the guard. Exits with CMD's exit code.
Standard library and gateway.supervisor.process only: it must start fast and stay small.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
from types import FrameType

from gateway.supervisor.process import terminate_group

_ORPHAN_GRACE = 2.0


def _watch_stdin(gone: threading.Event) -> None:
    while os.read(0, 4096):
        pass
    gone.set()


def main(argv: list[str] | None = None) -> int:
    """Run the guarded command; returns its exit code (128 + signal when the guard ended it)."""
    parser = argparse.ArgumentParser(prog="gateway.supervisor.guard")
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
    while child.poll() is None and not stop.is_set():
        stop.wait(0.1)
    me = os.getpid()
    # When the command ended by itself, what is left are its orphaned helpers: no need to wait long.
    grace = args.grace if stop.is_set() else min(args.grace, _ORPHAN_GRACE)
    terminate_group(os.getpgid(me), grace, exclude=me)
    code = child.wait()
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
