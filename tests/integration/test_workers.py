"""`nemotron-gateway serve --workers 2`: one port, two processes, limits exact across them, a killed worker
replaced, both drained on SIGTERM.

Which worker answers is the kernel's choice; the tests make it theirs by stopping the other one (SIGSTOP):
a stopped process accepts nothing, so the next connection goes to the one left running.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from loadtest.gpu.sweep import children_by_parent
from tests.procs import REPO_ROOT, FakeEngineControl, ServerProcess, run_gateway, wait_until

pytestmark = pytest.mark.timeout(120)

PEPPER = "workers-test-pepper"
RPM = 6


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (the pool's workers)."""
    return sorted(children_by_parent().get(pid, []))


def _two_workers(pid: int, gone: int | None = None) -> list[int] | None:
    """The pool's two workers once it has two (none of them `gone`), else None."""
    workers = _children(pid)
    return workers if len(workers) == 2 and gone not in workers else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@contextlib.contextmanager
def _only(running: int, workers: list[int]) -> Iterator[None]:
    """Every worker but `running` stopped (SIGSTOP) for the block, so `running` accepts every new connection."""
    stopped = [pid for pid in workers if pid != running]
    for pid in stopped:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def _create_key(redis_url: str, name: str = "workers", *limits: str) -> str:
    limits = limits or ("--rpm", str(RPM), "--tpm", "0", "--max-concurrency", "100")
    argv = [sys.executable, "-m", "gateway", "keys", "create", "--name", name, *limits, "--redis-url", redis_url]
    env = {**os.environ, "NEMOTRON_AUTH__SECRET": PEPPER}
    done = subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


def _post(url: str, secret: str, **body: Any) -> httpx.Response:
    # A new connection per request: a kept-alive one would stay with the worker that accepted it.
    payload = {"model": "nemotron-test", "prompt": "hi", "max_tokens": 1, **body}
    with httpx.Client(timeout=30.0) as client:
        return client.post(url + "/v1/completions", json=payload, headers={"Authorization": f"Bearer {secret}"})


def _ready(url: str) -> bool:
    try:
        with httpx.Client(timeout=5.0) as client:
            return client.get(url + "/ready").status_code == 200
    except httpx.TransportError:
        return False


@pytest.fixture
def pool(engine: FakeEngineControl, redis_clean: str) -> Iterator[tuple[ServerProcess, str, str]]:
    """A two-worker gateway with a key limited to RPM requests a minute, each worker seen ready on its own."""
    secret = _create_key(redis_clean)
    env = {"NEMOTRON_WORKERS": "2", "NEMOTRON_AUTH__SECRET": PEPPER, "NEMOTRON_RELAY__PROBE_INTERVAL": "0.2"}
    with run_gateway(engine.base_url, redis_clean, env=env) as proc:
        url = f"http://127.0.0.1:{proc.port}"
        workers = wait_until(lambda: _two_workers(proc.pid), timeout=30)
        for worker in workers:
            with _only(worker, workers):
                wait_until(lambda: _ready(url), timeout=30, message=f"worker {worker} never ready")
        yield proc, url, secret


def test_limits_are_exact_across_workers(pool: tuple[ServerProcess, str, str]) -> None:
    proc, url, secret = pool
    first, second = _children(proc.pid)
    with _only(first, [first, second]):
        answered = [_post(url, secret).status_code for _ in range(RPM - 2)]
    with _only(second, [first, second]):
        answered += [_post(url, secret).status_code for _ in range(4)]
    # The second worker knows what the first admitted: its third request is over the key's limit.
    assert answered == [200] * RPM + [429, 429]


def test_a_client_at_its_concurrency_limit_is_not_refused_by_either_worker(
    pool: tuple[ServerProcess, str, str], redis_clean: str
) -> None:
    # An answer goes out once its request's release is written to Redis, without waiting for Redis's reply: the
    # client's next request, on a new connection that either worker may accept, must still find the slot free.
    _, url, _ = pool
    secret = _create_key(redis_clean, "one-at-a-time", "--max-concurrency", "1", "--rpm", "0", "--tpm", "0")
    payload = {"model": "nemotron-test", "prompt": "hi", "max_tokens": 1}
    headers = {"Authorization": f"Bearer {secret}"}
    with httpx.Client(timeout=30.0, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        answered = [client.post(url + "/v1/completions", json=payload, headers=headers) for _ in range(200)]
    refused = [response.text for response in answered if response.status_code != 200]
    assert not refused, refused[:3]


def test_a_killed_worker_is_replaced_and_serves(pool: tuple[ServerProcess, str, str]) -> None:
    proc, url, secret = pool
    victim, survivor = _children(proc.pid)
    os.kill(victim, signal.SIGKILL)
    workers = wait_until(lambda: _two_workers(proc.pid, gone=victim), timeout=30)
    (replacement,) = set(workers) - {survivor}
    with _only(replacement, workers):
        wait_until(lambda: _ready(url), timeout=30, message="the replacement never served /ready")
        assert _post(url, secret).status_code == 200
    assert proc.running


def test_sigterm_drains_every_worker(pool: tuple[ServerProcess, str, str]) -> None:
    proc, url, secret = pool
    workers = _children(proc.pid)
    body = {"model": "nemotron-test", "prompt": "hi", "max_tokens": 20, "stream": True, "fake_token_delay": 0.05}
    with httpx.Client(timeout=30.0) as client:
        with client.stream(
            "POST", url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {secret}"}
        ) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")  # the stream is open in one of the workers
            proc.send_signal(signal.SIGTERM)
            rest = list(lines)
    assert "data: [DONE]" in rest
    assert proc.stop(timeout=30) == 0
    assert not any(_alive(pid) for pid in workers)


def test_workers_end_when_the_pool_parent_is_killed_outright(pool: tuple[ServerProcess, str, str]) -> None:
    # Nothing may keep serving the port unsupervised once the process that replaces and drains them is gone.
    proc, url, _ = pool
    workers = _children(proc.pid)
    assert len(workers) == 2
    os.kill(proc.pid, signal.SIGKILL)  # the parent alone (ServerProcess.send_signal signals the whole group)
    wait_until(lambda: not any(_alive(pid) for pid in workers), timeout=30, message="workers outlived their pool")
    assert not _ready(url)


def test_once_ready_answers_200_every_worker_serves(engine: FakeEngineControl, redis_clean: str) -> None:
    # Each worker watches the engine on its own probe interval; a worker that last saw the engine down must
    # not refuse the request that follows another worker's /ready 200.
    env = {"NEMOTRON_WORKERS": "2", "NEMOTRON_AUTH__ENABLED": "false", "NEMOTRON_RELAY__PROBE_INTERVAL": "1"}
    with run_gateway(engine.base_url, redis_clean, env=env) as proc:
        url = f"http://127.0.0.1:{proc.port}"
        first, second = workers = wait_until(lambda: _two_workers(proc.pid), timeout=30)
        engine.set_health(503)
        for worker in workers:
            with _only(worker, workers):
                wait_until(lambda: not _ready(url), timeout=10, message=f"worker {worker} never saw it down")
        with _only(first, workers):  # the second is stopped: it cannot probe while the engine comes back
            # A /health that answers in 0.3 s: the second worker's own overdue probe, started when it resumes,
            # is still running when the next request reaches it.
            engine.set_health(200, delay=0.3)
            wait_until(lambda: _ready(url), timeout=10, message="the first worker never saw it back")
        with _only(second, workers):
            assert _ready(url)
            answer = httpx.post(url + "/v1/completions", json={"model": "nemotron-test", "prompt": "hi"}, timeout=30)
            assert answer.status_code == 200, answer.text
