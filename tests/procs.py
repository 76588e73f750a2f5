"""Real server processes for tests: free ports, start/ready/stop in a process group, polling, the fake engine; and
the gateway's own server (uvicorn with its protocol) serving an app in the test's loop (`serving_on_loopback`).

The runner is the one the load tool uses too (`loadtest.processes.LoggedProcess`, kept out of the gateway package);
the fake engine is spoken to over HTTP only.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import socket
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Self, TypeVar, overload

import httpx

from gateway.http.client_limits import ClientLimits
from gateway.http.uvicorn_internals import DrainingServer, GuardedHttpToolsProtocol, ServerConfig
from gateway.settings import Settings
from gateway.types import ASGIApp
from loadtest.processes import LoggedProcess, ProcessStartError, free_port

REPO_ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout: float = 5.0, interval: float = 0.02, message: str = "") -> T:
    """Poll `predicate` until it returns something truthy and return that; AssertionError at `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() >= deadline:
            raise AssertionError(message or f"condition not met within {timeout}s (last value: {result!r})")
        time.sleep(interval)


@overload
async def async_wait_until(
    predicate: Callable[[], Awaitable[T]], within: float = ..., interval: float = ..., message: str = ...
) -> T: ...


@overload
async def async_wait_until(
    predicate: Callable[[], T], within: float = ..., interval: float = ..., message: str = ...
) -> T: ...


async def async_wait_until(
    predicate: Callable[[], Any], within: float = 5.0, interval: float = 0.02, message: str = ""
) -> Any:
    """`wait_until` for async tests: sleeps on the loop and awaits the predicate's result if it is awaitable.

    The limit is `within`, not `timeout` (ruff ASYNC109 reserves that name for asyncio.timeout).
    """
    deadline = time.monotonic() + within
    while True:
        result: Any = predicate()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result
        if time.monotonic() >= deadline:
            raise AssertionError(message or f"condition not met within {within}s (last value: {result!r})")
        await asyncio.sleep(interval)


# One name for a server that exited or never became ready, whichever runner raised it.
ServerProcessError = ProcessStartError


class ServerProcess(LoggedProcess):
    """The process runner (`LoggedProcess`) for a test's server: ready when its URL or check answers.

    `with ServerProcess(argv, ready_url=...) as proc:` starts and waits; leaving the block stops it:
    SIGTERM to the group, up to `stop_timeout` seconds, then SIGKILL to the group.
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
        ready_url: str | None = None,
        ready_status: int = 200,
        ready_check: Callable[[], bool] | None = None,
        start_timeout: float = 20.0,
        stop_timeout: float = 5.0,
        port: int | None = None,
    ) -> None:
        environment = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        super().__init__(argv, env=environment, cwd=cwd if cwd is not None else REPO_ROOT)
        self.ready_url = ready_url
        self.ready_status = ready_status
        self.ready_check = ready_check
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.port = port

    def start(self, wait: bool = True) -> Self:
        """Spawn it and, with `wait`, block until ready (stopping it again if it never is)."""
        super().start()
        if wait:
            try:
                self.wait_ready()
            except BaseException:
                self.stop()
                raise
        return self

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until the ready URL answers `ready_status` (or `ready_check()` is true); raise if it exits."""
        within = self.start_timeout if timeout is None else timeout
        check = self.ready_check
        self.wait_until_ready(self.ready_url, within, status=self.ready_status, check=check and self._unrefused(check))

    @staticmethod
    def _unrefused(check: Callable[[], bool]) -> Callable[[], bool]:
        """`check`, with a connection it could not make (the server not listening yet) read as not ready."""

        def ready() -> bool:
            try:
                return check()
            except httpx.TransportError:
                return False

        return ready

    def stop(self, timeout: float | None = None) -> int | None:
        """SIGTERM the group, wait up to `timeout` (default `stop_timeout`), then SIGKILL it; the exit code."""
        return super().stop(self.stop_timeout if timeout is None else timeout)


def fake_engine_argv(port: int, **options: Any) -> list[str]:
    """argv for `python -m tests.fakes.fake_engine`; `max_model_len=8` becomes `--max-model-len 8`, True a flag."""
    argv = [sys.executable, "-m", "tests.fakes.fake_engine", "--port", str(port)]
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is not False and value is not None:
            argv += [flag, str(value)]
    return argv


def run_fake_engine(port: int | None = None, *, wait: bool = True, **options: Any) -> ServerProcess:
    """Start the fake engine (cwd = repo root) and, unless `wait=False`, wait for its /health; caller stops it."""
    port = free_port() if port is None else port
    start_timeout = 20.0 + float(options.get("startup_delay", 0.0))
    proc = ServerProcess(
        fake_engine_argv(port, **options),
        cwd=REPO_ROOT,
        ready_url=f"http://127.0.0.1:{port}/health",
        start_timeout=start_timeout,
        port=port,
    )
    return proc.start(wait=wait)


class FakeEngineControl:
    """A running fake engine and its /_test/* API; sync methods for fixtures, `a`-prefixed ones for async tests.

    The async ones matter when the gateway runs on the test's own event loop: a sync call would stall it.
    """

    def __init__(self, process: ServerProcess) -> None:
        if process.port is None:
            raise ValueError("the fake engine's ServerProcess needs a port")
        self.process = process
        self.port = process.port
        self.base_url = f"http://127.0.0.1:{self.port}"

    def _call(self, method: str, path: str, json: Any = None) -> Any:
        with httpx.Client(base_url=self.base_url, timeout=5.0) as client:
            response = client.request(method, path, json=json)
            response.raise_for_status()
            return response.json()

    async def _acall(self, method: str, path: str, json: Any = None) -> Any:
        async with httpx.AsyncClient(base_url=self.base_url, timeout=5.0) as client:
            response = await client.request(method, path, json=json)
            response.raise_for_status()
            return response.json()

    def requests(self) -> list[dict[str, Any]]:
        """Every completion request since the last reset, oldest first."""
        result: list[dict[str, Any]] = self._call("GET", "/_test/requests")
        return result

    def request(self, request_id: str) -> dict[str, Any]:
        """The record of the request that carried `x-request-id: request_id`."""
        result: dict[str, Any] = self._call("GET", f"/_test/requests/{request_id}")
        return result

    def stats(self) -> dict[str, int]:
        result: dict[str, int] = self._call("GET", "/_test/stats")
        return result

    def reset(self) -> None:
        """Forget recorded requests and counters (not in-flight gauges) and make /health answer 200 again."""
        self._call("POST", "/_test/reset")

    def set_health(self, status: int, hang: bool = False, delay: float = 0.0) -> None:
        """/health answers `status` after `delay` s (an API server saturated by load), or never (`hang`)."""
        self._call("POST", "/_test/health", {"status": status, "hang": hang, "delay": delay})

    def freeze(self, frozen: bool = True) -> None:
        """Stop (or resume) generation while /health keeps answering: a stopped engine core."""
        self._call("POST", "/_test/freeze", {"frozen": frozen})

    async def arequests(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = await self._acall("GET", "/_test/requests")
        return result

    async def arequest(self, request_id: str) -> dict[str, Any]:
        result: dict[str, Any] = await self._acall("GET", f"/_test/requests/{request_id}")
        return result

    async def astats(self) -> dict[str, int]:
        result: dict[str, int] = await self._acall("GET", "/_test/stats")
        return result

    async def areset(self) -> None:
        await self._acall("POST", "/_test/reset")

    async def aset_health(self, status: int, hang: bool = False, delay: float = 0.0) -> None:
        await self._acall("POST", "/_test/health", {"status": status, "hang": hang, "delay": delay})

    async def afreeze(self, frozen: bool = True) -> None:
        await self._acall("POST", "/_test/freeze", {"frozen": frozen})


def run_gateway(
    engine_url: str,
    redis_url: str,
    *,
    port: int | None = None,
    wait_ready: bool = True,
    env: Mapping[str, str] | None = None,
) -> ServerProcess:
    """Start `nemotron-gateway serve` as a subprocess; `env` adds NEMOTRON_* settings. Caller stops it.

    With `wait_ready` it waits for /ready (engine and Redis answer), else only for /health.
    """
    port = free_port() if port is None else port
    argv = [sys.executable, "-m", "gateway", "serve", "--port", str(port), "--engine-url", engine_url]
    argv += ["--redis-url", redis_url]
    path = "/ready" if wait_ready else "/health"
    proc = ServerProcess(
        argv,
        # One process unless a test asks for more: a test that reads /metrics or a log reads one worker's.
        env={"NEMOTRON_LOG_LEVEL": "info", "NEMOTRON_WORKERS": "1", **(env or {})},
        cwd=REPO_ROOT,
        ready_url=f"http://127.0.0.1:{port}{path}",
        port=port,
    )
    return proc.start()


@contextlib.asynccontextmanager
async def serving_on_loopback(app: ASGIApp) -> AsyncIterator[int]:
    """`app` served by the gateway's server (`GuardedHttpToolsProtocol`, default client limits, no lifespan) on a
    loopback port in this loop; its port, the server stopped on leaving."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    settings = Settings()
    config = ServerConfig(
        app, limits=ClientLimits.from_settings(settings), http=GuardedHttpToolsProtocol, lifespan="off", log_config=None
    )
    server = DrainingServer(config)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        await async_wait_until(lambda: server.started, within=10, message="the server never started")
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(serving, 10)
        sock.close()
