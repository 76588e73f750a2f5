"""GuardedProcess: a child command in its own process group, behind a reaper that outlives nothing.

`vllm serve` forks EngineCore and Worker processes; killing only its pid leaves them running with
gigabytes held, and SIGKILL of the group leaves POSIX shared memory in /dev/shm. So the command runs
under `python -m gateway.supervisor.reaper`, the group leader, which tears down the whole group (SIGTERM,
grace, SIGKILL, /dev/shm clean-up) when asked, when the command exits, and when the supervisor dies
for any reason, SIGKILL included (its stdin pipe from the supervisor reaches EOF). Imports nothing of
the HTTP app.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

_SHM = "/dev/shm/"
# Seconds the reaper gets to clean up after its command's group was SIGKILLed (scans of /proc: well under 1 s).
_REAPER_CLEANUP = 5.0
# Seconds the rest of the group's output gets to reach EOF once the reaper has exited.
_OUTPUT_DRAIN = 2.0


def group_members(pgid: int, *, exclude: int | None = None) -> list[int]:
    """Pids of the live processes in process group `pgid` (read from /proc; zombies left out)."""
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        # Fields after the parenthesised command: state, ppid, pgrp, ...
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z" and int(fields[2]) == pgid and int(entry.name) != exclude:
            members.append(int(entry.name))
    return members


def shared_memory_of(pids: Sequence[int]) -> set[str]:
    """The /dev/shm files these processes have mapped or open (what a SIGKILL leaves behind)."""
    paths: set[str] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                start = line.find(_SHM)
                if start >= 0:
                    paths.add(line[start:].removesuffix(" (deleted)"))
        with contextlib.suppress(OSError):
            for fd in os.scandir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(fd.path)
                    if target.startswith(_SHM):
                        paths.add(target.removesuffix(" (deleted)"))
    return paths


def shared_memory_inodes(pids: Sequence[int]) -> set[int]:
    """Inodes of the /dev/shm files these processes have mapped or open.

    By inode, not by name: glibc's sem_open() creates a semaphore under a temporary name, maps it, links
    it to its final name (vLLM's `sem.mp-*`) and unlinks the temporary one, so /proc/<pid>/maps never
    shows the name that is left behind.
    """
    inodes: set[int] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                fields = line.split(maxsplit=5)  # address perms offset dev inode path
                if len(fields) == 6 and fields[5].startswith(_SHM):
                    inodes.add(int(fields[4]))
        with contextlib.suppress(OSError):
            for fd in os.scandir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(fd.path).startswith(_SHM):
                        inodes.add(os.stat(fd.path).st_ino)
    return inodes


def held_inodes() -> set[int]:
    """Inodes of the /dev/shm files any live process (any we may read) maps or holds open."""
    return shared_memory_inodes([int(entry.name) for entry in os.scandir("/proc") if entry.name.isdigit()])


def remove_files(paths: set[str], inodes: set[int] | None = None) -> int:
    """Unlink the /dev/shm files named in `paths` or with one of `inodes`, if ours and no live process holds them.

    Returns how many were removed. A file another process still uses is not ours to remove, nor is a file
    of another user.
    """
    wanted = set(inodes or ())
    for path in paths:
        with contextlib.suppress(OSError):
            wanted.add(os.stat(path).st_ino)
    if not wanted:
        return 0
    wanted -= held_inodes()
    removed = 0
    with contextlib.suppress(OSError):
        for entry in os.scandir(_SHM):
            with contextlib.suppress(OSError):
                if entry.inode() in wanted and entry.is_file(follow_symlinks=False):
                    if entry.stat(follow_symlinks=False).st_uid == os.getuid():
                        os.unlink(entry.path)
                        removed += 1
    return removed


def signal_pids(pids: Sequence[int], sig: int) -> None:
    """Send `sig` to each pid that still exists."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def terminate_group(pgid: int, grace: float, *, exclude: int | None = None, seen: set[int] | None = None) -> int:
    """SIGTERM every member of the group, wait up to `grace` s, SIGKILL what is left, clean /dev/shm.

    `seen`: inodes of /dev/shm files the group held earlier (removed too, once nobody holds them).
    Returns the number of processes that had to be killed. Blocking (used by the reaper process).
    """
    members = group_members(pgid, exclude=exclude)
    shm = shared_memory_of(members)
    inodes = shared_memory_inodes(members) | (seen or set())
    signal_pids(members, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while members and time.monotonic() < deadline:
        time.sleep(0.05)
        members = group_members(pgid, exclude=exclude)
        shm |= shared_memory_of(members)
        inodes |= shared_memory_inodes(members)
    signal_pids(members, signal.SIGKILL)
    while group_members(pgid, exclude=exclude):
        time.sleep(0.02)
    removed = remove_files(shm, inodes)
    if members or removed:
        logger.warning("killed %d leftover process(es), removed %d /dev/shm file(s)", len(members), removed)
    return len(members)


def process_names(pids: Sequence[int]) -> dict[int, str]:
    """pid -> command name (vLLM names its processes, e.g. `VLLM::EngineCore`, `VLLM::Worker_TP1`)."""
    names: dict[int, str] = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            names[pid] = Path(f"/proc/{pid}/comm").read_text().strip()
    return names


class MemberWatch:
    """The processes of an engine, each watched through a pidfd: `first_exit()` returns when one of them ends.

    For an engine of several processes (vLLM's EngineCore, a worker per GPU of tensor parallel, one engine per
    data-parallel rank): one of them killed (the OOM killer, a GPU fault, kill -9) can leave the API server up
    with peers blocked in a collective, so the whole engine is restarted. A pidfd works for processes that are not
    our children; the event loop waits on it, so watching costs nothing while they run.
    """

    def __init__(self, pids: Sequence[int]) -> None:
        self.names = process_names(pids)
        self._fds: dict[int, int] = {}
        for pid in self.names:
            with contextlib.suppress(OSError):  # already gone: the next snapshot has no such member
                self._fds[pid] = os.pidfd_open(pid)

    @property
    def pids(self) -> list[int]:
        """The watched processes."""
        return sorted(self._fds)

    async def first_exit(self) -> int:
        """The pid of the first watched process that ends (waits forever when none is watched)."""
        loop = asyncio.get_running_loop()
        ended: asyncio.Future[int] = loop.create_future()

        def on_exit(pid: int) -> None:
            if not ended.done():
                ended.set_result(pid)

        for pid, fd in self._fds.items():
            loop.add_reader(fd, on_exit, pid)
        try:
            return await ended
        finally:
            for fd in self._fds.values():
                loop.remove_reader(fd)

    def close(self) -> None:
        """Release the pidfds."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}


class GuardedProcess:
    """Runs `argv` under the reaper; its output lines go to `on_line` and a ring buffer."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        grace: float = 15.0,
        log_lines: int = 200,
        on_line: Callable[[str], None] | None = None,
    ) -> None:
        self.argv = list(argv)
        self.env = dict(env) if env is not None else None
        self.grace = grace
        self.tail: collections.deque[str] = collections.deque(maxlen=log_lines)
        self._on_line = on_line
        self._proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None
        self._output: asyncio.ReadTransport | None = None
        self._command_pid: int | None = None
        self._shm_seen: set[int] = set()
        self._ending: asyncio.Future[int] | None = None
        self.stopping = False
        # True once the reaper was found killed with its group still running (that group was then ended).
        self.orphaned = False

    @property
    def pid(self) -> int | None:
        """The reaper's pid (also the process group id), once started."""
        return None if self._proc is None else self._proc.pid

    @property
    def command_pid(self) -> int | None:
        """The command's own pid (the reaper's child), once it is running."""
        if self._command_pid is None and self._proc is not None and self._proc.returncode is None:
            pid = self._proc.pid
            with contextlib.suppress(OSError, ValueError):
                children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
                self._command_pid = int(children[0]) if children else None
        return self._command_pid

    @property
    def returncode(self) -> int | None:
        """The command's exit code once it has ended (negative: killed by that signal)."""
        return None if self._proc is None else self._proc.returncode

    @property
    def last_line(self) -> str:
        """The latest output line (for progress reports)."""
        return self.tail[-1] if self.tail else ""

    async def start(self) -> None:
        """Spawn the reaper in a new session (its own process group) with a stdin pipe kept by us.

        The output pipe is ours, not the subprocess transport's: asyncio's `Process.wait()` also waits for every
        pipe it made to close, and a process that leaves the group (a new session of its own) can keep one open
        long after the engine has ended."""
        reaper = [sys.executable, "-m", "gateway.supervisor.reaper", "--grace", str(self.grace), "--", *self.argv]
        read_end, write_end = os.pipe()
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *reaper,
                stdin=asyncio.subprocess.PIPE,
                stdout=write_end,
                stderr=asyncio.subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )
        except BaseException:
            os.close(read_end)  # no reaper: nothing will read it
            raise
        finally:
            os.close(write_end)
        output = asyncio.StreamReader()
        self._output, _ = await asyncio.get_running_loop().connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(output), os.fdopen(read_end, "rb", 0)
        )
        self._reader = asyncio.create_task(self._read_output(output), name=f"output-{self._proc.pid}")

    async def _read_output(self, output: asyncio.StreamReader) -> None:
        async for raw in output:
            line = raw.decode("utf-8", "replace").rstrip()
            self.tail.append(line)
            if self._on_line is not None:
                self._on_line(line)

    async def wait(self) -> int:
        """Wait for the command (and its reaper) to end and its group to be gone; its exit code.

        Any number of callers may wait; the clean-up after the reaper's end runs once."""
        assert self._proc is not None
        if self._ending is None:
            self._ending = asyncio.ensure_future(self._end())
        return await asyncio.shield(self._ending)

    async def _end(self) -> int:
        assert self._proc is not None
        code = await self._proc.wait()
        group = self._proc.pid
        if code < 0 and group_members(group):
            # The reaper alone was killed (`kill -9` of its pid): the group it led runs on, holding the engine's
            # port and memory, and nothing else would ever end it.
            self.orphaned = True
            logger.error("reaper %d was killed by signal %d; ending the process group it led", group, -code)
            await asyncio.to_thread(terminate_group, group, self.grace, seen=self._shm_seen)
            self._shm_seen = set()
        if self._reader is not None:
            # The rest of the output, up to EOF. A process that left the group may hold the pipe open for good:
            # the engine's end is reported without it.
            with contextlib.suppress(asyncio.CancelledError):
                try:
                    await asyncio.wait_for(self._reader, _OUTPUT_DRAIN)
                except TimeoutError:
                    logger.warning(
                        "engine output still open %.0f s after its reaper ended; not read further", _OUTPUT_DRAIN
                    )
        if self._output is not None:
            self._output.close()
        if code < 0 and self._shm_seen:
            # The reaper was killed with its group (`kill -9 -PGID`, the OOM killer): nobody removed the group's
            # /dev/shm files, so we do, once the group is gone (remove_files spares any a live process holds).
            await self._wait_group_gone(group)
            removed = remove_files(set(), self._shm_seen)
            logger.warning("process group %d was killed; removed %d /dev/shm file(s) it held", group, removed)
            self._shm_seen = set()
        return code

    def members(self) -> list[int]:
        """The command and every process it started that is still in its group (the reaper left out)."""
        if self._proc is None or self._proc.returncode is not None:
            return []
        return group_members(self._proc.pid, exclude=self._proc.pid)

    def sample_shared_memory(self) -> None:
        """Remember the /dev/shm files the group holds now, for when the whole group, reaper included, dies."""
        if self._proc is not None and self._proc.returncode is None:
            self._shm_seen |= shared_memory_inodes(group_members(self._proc.pid))

    @staticmethod
    async def _wait_group_gone(pgid: int, within: float = 5.0) -> None:
        deadline = time.monotonic() + within
        while group_members(pgid) and time.monotonic() < deadline:  # noqa: ASYNC110  # no event exists for non-child exits
            await asyncio.sleep(0.02)

    async def stop(self) -> int | None:
        """SIGTERM the group (the reaper then waits `grace` and SIGKILLs the rest); SIGKILL if the reaper hangs.

        When the reaper has already ended, this waits for what `wait()` does after it (a group left running ended)."""
        if self._proc is None:
            return None
        if self._proc.returncode is not None:
            return await self.wait()
        self.stopping = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._proc.pid, signal.SIGTERM)
        try:
            return await asyncio.wait_for(self.wait(), self.grace + 5.0)
        except TimeoutError:
            logger.error("reaper %d did not finish within %.0f s; killing its group", self._proc.pid, self.grace + 5)
            await self.kill()
            return await self.wait()

    async def kill(self) -> None:
        """SIGKILL the whole group now and remove the shared memory it held (a hung engine).

        The reaper itself is spared: it saw the command's /dev/shm files while they were in use (some are
        let go long before the end), so it removes them once the group is gone and then exits. Only when
        it does not exit within `_REAPER_CLEANUP` s is it killed too.
        """
        if self._proc is None:
            return
        if self._proc.returncode is not None:
            await self.wait()
            return
        self.stopping = True
        reaper = self._proc.pid
        members = group_members(reaper, exclude=reaper)
        shm, inodes = shared_memory_of(members), shared_memory_inodes(members)
        signal_pids(members, signal.SIGKILL)
        try:
            await asyncio.wait_for(self.wait(), _REAPER_CLEANUP)
        except TimeoutError:
            logger.error("reaper %d did not exit after its command was killed; killing it", reaper)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(reaper, signal.SIGKILL)
        await self._wait_group_gone(reaper)
        # Also the files the group held earlier: a member that died first (the one whose exit asked for this kill)
        # took its hold with it, and the reaper may not have scanned while it lived.
        remove_files(shm, inodes | self._shm_seen)
        self._shm_seen = set()
