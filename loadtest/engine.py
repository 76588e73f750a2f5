"""An engine started through the project's supervisor with one profile: `python -m gateway engine` as a child.

The supervisor is driven across the process boundary only: its settings through `NEMOTRON_ENGINE__*`
variables, its state through the status file `<state dir>/engine.json`, readiness through the engine's
`/health`. Stopping is SIGTERM to the supervisor (which drains and stops vLLM), SIGKILL after a grace
period, and a last SIGKILL for a vLLM process group the supervisor left behind. It imports nothing of `gateway`.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from loadtest.processes import BenchProcess, http_status

logger = logging.getLogger(__name__)

_POLL_S = 0.5


class EngineStartError(RuntimeError):
    """The supervisor failed, exited, or the engine was not ready in time; the message has the log's tail."""


@dataclass(frozen=True, slots=True)
class EngineLaunch:
    """How to start the engine for one profile."""

    profile: str
    port: int
    state_dir: Path
    model_path: str | None = None
    profiles_file: Path | None = None
    start_timeout: float = 900.0
    stop_grace: float = 15.0
    python: str = sys.executable

    def env(self) -> dict[str, str]:
        """The supervisor's settings (environment variables it reads)."""
        env = {
            "NEMOTRON_ENGINE__PROFILE": self.profile,
            "NEMOTRON_ENGINE__PORT": str(self.port),
            "NEMOTRON_ENGINE__STATE_DIR": str(self.state_dir),
            "NEMOTRON_ENGINE__METRICS_PORT": "0",
            "NEMOTRON_ENGINE__STOP_GRACE": str(self.stop_grace),
        }
        if self.model_path:
            env["NEMOTRON_ENGINE__MODEL"] = self.model_path
        if self.profiles_file is not None:
            env["NEMOTRON_ENGINE__PROFILES_FILE"] = str(self.profiles_file)
        return env

    @property
    def url(self) -> str:
        """The engine's base URL."""
        return f"http://127.0.0.1:{self.port}"


class SupervisedEngine:
    """`with SupervisedEngine(launch) as engine:` starts the supervisor and waits until the engine is ready."""

    def __init__(self, launch: EngineLaunch) -> None:
        self.launch = launch
        self._process = BenchProcess(
            f"engine-{launch.profile}", [launch.python, "-m", "gateway", "engine"], core=None, env=launch.env()
        )
        self._status_path = launch.state_dir / "engine.json"
        self._started = 0.0
        self.started_s: float | None = None

    def __enter__(self) -> SupervisedEngine:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def start(self) -> None:
        """Spawn the supervisor (its own process group)."""
        self.launch.state_dir.mkdir(parents=True, exist_ok=True)
        self._started = time.monotonic()
        self._process.start()

    def status(self) -> dict[str, object] | None:
        """This supervisor's last status record (a stale file from another supervisor reads as None)."""
        try:
            status = json.loads(self._status_path.read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(status, dict) or status.get("supervisor_pid") != self._process.pid:
            return None
        return status

    def wait_ready(self) -> None:
        """Until the status file says ready and `/health` answers 200; EngineStartError on failure or timeout."""
        deadline = time.monotonic() + self.launch.start_timeout
        while time.monotonic() < deadline:
            code = self._process.poll()
            if code is not None:
                raise EngineStartError(f"supervisor exited with {code}:\n{self._process.log_tail(4000)}")
            status = self.status() or {}
            if status.get("state") == "failed":
                raise EngineStartError(f"engine failed: {status.get('reason')}\n{self._process.log_tail(4000)}")
            if status.get("state") == "ready" and _healthy(self.launch.url + "/health"):
                self.started_s = round(time.monotonic() - self._started, 1)
                logger.info("profile %s ready in %.0f s", self.launch.profile, self.started_s)
                return
            time.sleep(_POLL_S)
        raise EngineStartError(
            f"engine not ready within {self.launch.start_timeout:g} s:\n{self._process.log_tail(4000)}"
        )

    def stop(self) -> None:
        """SIGTERM the supervisor, SIGKILL after a grace period; then make sure its vLLM group is gone."""
        status = self.status() or {}
        engine_pid = status.get("engine_pid")
        self._process.stop(grace=self.launch.stop_grace + 20)
        if isinstance(engine_pid, int):
            _kill_leftover_group(engine_pid)


def wait_http(url: str, within: float) -> None:
    """Poll `url` until it answers 200; TimeoutError after `within` seconds."""
    deadline = time.monotonic() + within
    while not _healthy(url):
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{url} did not answer 200 within {within:g} s")
        time.sleep(_POLL_S)


def _healthy(url: str) -> bool:
    return http_status(url, timeout=2.0) == 200


def _kill_leftover_group(pid: int) -> None:
    """SIGKILL the process group of a vLLM server the supervisor did not stop (only if it still is vLLM)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        pgid = os.getpgid(pid)
    except (OSError, ProcessLookupError):
        return
    if b"vllm" not in cmdline or pgid != pid:
        return
    logger.warning("engine process group %d outlived its supervisor: SIGKILL", pgid)
    os.killpg(pgid, signal.SIGKILL)
