"""Replacing a gateway process without losing a request, on this machine without systemd.

The test plays systemd's part in socket activation: it holds the listening socket and hands it to each
gateway process as fd 3 with LISTEN_FDS/LISTEN_PID, starting the new process once the old one has exited,
as `systemctl restart` does. tests/deploy runs the same under a real systemd.
"""

from __future__ import annotations

import asyncio
import http.client
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.procs import REPO_ROOT, FakeEngineControl, async_wait_until, free_port, run_gateway, wait_until

pytestmark = pytest.mark.timeout(120)

GRACE = 3.0
MODEL = "nemotron-test"


def _chat(**extra: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}


@contextmanager
def _activated_gateway(
    listener: socket.socket, engine_url: str, redis_url: str, workers: int
) -> Iterator[subprocess.Popen[bytes]]:
    """`nemotron-gateway serve` given `listener` as systemd gives it: fd 3, LISTEN_FDS=1, LISTEN_PID its pid.

    Its own NEMOTRON_PORT is another free port, so only a gateway that serves the passed socket answers.
    """
    fd = listener.fileno()
    # A small launcher moves the socket to fd 3 and names its own pid, which exec keeps (systemd's way).
    launcher = (
        f"import os, sys; os.dup2({fd}, 3); os.close({fd}); "
        "os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS='1'); "
        "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
    )
    argv = [sys.executable, "-c", launcher, "-m", "gateway", "serve", "--engine-url", engine_url]
    env = {
        **os.environ,
        "NEMOTRON_PORT": str(free_port()),
        "NEMOTRON_REDIS_URL": redis_url,
        "NEMOTRON_AUTH__ENABLED": "false",
        "NEMOTRON_SHUTDOWN_GRACE": str(GRACE),
        "NEMOTRON_WORKERS": str(workers),
    }
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(
            argv, cwd=REPO_ROOT, env=env, pass_fds=(fd,), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            yield proc
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
            log.seek(0)
            sys.stderr.write(log.read().decode(errors="replace")[-3000:])


def _holders(pgid: int, listener: socket.socket) -> list[int]:
    """Processes of the gateway's process group that still hold `listener` (so may accept from it)."""
    name = f"socket:[{os.fstat(listener.fileno()).st_ino}]"
    holders = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and os.getpgid(int(entry.name)) == pgid:
                if any(os.readlink(fd) == name for fd in (entry / "fd").iterdir()):
                    holders.append(int(entry.name))
        except OSError:
            continue
    return holders


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


@pytest.mark.parametrize("workers", [1, 2])
async def test_a_replaced_gateway_process_drops_no_request_and_finishes_its_streams(
    fake_engine: FakeEngineControl, redis_url: str, workers: int
) -> None:
    fake_engine.reset()
    listener = socket.create_server(("127.0.0.1", 0), backlog=1024)
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    failures: list[str] = []
    answered = 0
    first_tokens: list[float] = []
    waits: list[tuple[float, float]] = []  # (sent, answered) of requests sent after SIGTERM
    stop = asyncio.Event()
    term_at = float("inf")

    async def loop(client: httpx.AsyncClient) -> None:
        nonlocal answered
        while not stop.is_set():
            sent = time.monotonic()
            try:
                response = await client.post(f"{url}/v1/chat/completions", json=_chat(max_tokens=2))
                answered += response.status_code == 200
                if response.status_code != 200:
                    failures.append(f"{response.status_code} {response.text[:200]}")
            except httpx.HTTPError as exc:
                failures.append(repr(exc))
            if sent > term_at:
                waits.append((sent, time.monotonic()))

    async def fresh_connection() -> float:
        """A new connection made once the old process drains: when its request is answered."""
        await async_wait_until(lambda: not _holders(old.pid, listener), within=10)
        async with httpx.AsyncClient(timeout=httpx.Timeout(60.0)) as client:
            assert (await client.get(f"{url}/health")).status_code == 200
        return time.monotonic()

    async def stream(client: httpx.AsyncClient) -> list[str]:
        body = _chat(max_tokens=20, stream=True, fake_token_delay=0.05)
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            lines = []
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                    if len(lines) == 2:
                        first_tokens.append(time.monotonic())
            return lines

    with listener, _activated_gateway(listener, fake_engine.base_url, redis_url, workers) as old:
        await async_wait_until(lambda: _ready(url), within=30, message="the first gateway never served the socket")
        async with httpx.AsyncClient(timeout=httpx.Timeout(60.0)) as client:
            loops = [asyncio.create_task(loop(client)) for _ in range(4)]
            streams = [asyncio.create_task(stream(client)) for _ in range(2)]
            await async_wait_until(lambda: answered >= 8 and len(first_tokens) == 2, within=30)
            term_at = time.monotonic()
            os.killpg(old.pid, signal.SIGTERM)  # systemd's KillMode=control-group: every gateway process
            fresh = asyncio.create_task(fresh_connection())
            await asyncio.to_thread(old.wait, GRACE + 10)
            with _activated_gateway(listener, fake_engine.base_url, redis_url, workers):
                started_at = time.monotonic()
                await async_wait_until(lambda: any(sent > started_at for sent, _ in waits), within=30)
                stop.set()
                await asyncio.gather(*loops)
                ends = await asyncio.gather(*streams)
                fresh_answered_at = await fresh

    assert failures == [], failures[:10]
    for lines in ends:
        assert lines[-1] == "data: [DONE]" and not any('"error"' in line for line in lines), lines[-3:]
    # A connection made while the old process drained waited in the socket's queue for the new one.
    assert fresh_answered_at > started_at, "the draining process accepted a new connection"


def test_a_draining_gateway_answers_a_request_on_an_idle_keep_alive_connection(
    fake_engine: FakeEngineControl, redis_url: str
) -> None:
    # uvicorn alone closes idle keep-alive connections at once on SIGTERM, losing a request sent at that moment.
    with run_gateway(fake_engine.base_url, redis_url, env={"NEMOTRON_AUTH__ENABLED": "false"}) as gateway:
        assert gateway.port is not None
        conn = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=10)
        try:
            conn.request("GET", "/health")
            assert conn.getresponse().read() == b'{"status":"ok"}'
            gateway.send_signal(signal.SIGTERM)
            wait_until(lambda: _refused(gateway.port), timeout=10, message="the gateway kept accepting")
            conn.request("GET", "/health")  # on the same, idle keep-alive connection
            answer = conn.getresponse()
            assert (answer.status, answer.read()) == (200, b'{"status":"ok"}')
            assert answer.getheader("connection") == "close"
        finally:
            conn.close()


def _refused(port: int | None) -> bool:
    assert port is not None
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except ConnectionRefusedError:
        return True
    return False
