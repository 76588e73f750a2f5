"""`serve --workers 12`: readiness is one fact per gateway. A hung engine core (/health 200, no token) is not ready
in any worker until it generates again, the idle generation probe is sent once per gateway, a stop signal to the
pool parent turns every worker's /ready into 503 at once, and probes write no access-log line unless asked.

Each /ready is asked on a new connection, so the kernel hands it to any of the workers.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.procs import FakeEngineControl, ServerProcess, run_gateway, wait_until

pytestmark = pytest.mark.timeout(180)

WORKERS = 12
PROBE_INTERVAL = 0.3
ENV = {
    "NEMOTRON_WORKERS": str(WORKERS),
    "NEMOTRON_AUTH__ENABLED": "false",
    "NEMOTRON_RELAY__PROBE_INTERVAL": str(PROBE_INTERVAL),
    "NEMOTRON_RELAY__PROBE_TIMEOUT": "1",
    "NEMOTRON_RELAY__GENERATION_PROBE_TIMEOUT": "1",
    "NEMOTRON_RELAY__STALL_TIMEOUT": "3",
}


def _ready_status(url: str) -> int | None:
    """/ready's status on a new connection, or None when the connection is refused."""
    try:
        with httpx.Client(timeout=10.0) as client:
            return client.get(url + "/ready").status_code
    except httpx.ConnectError:
        return None


def _complete(url: str, **body: object) -> httpx.Response:
    payload = {"model": "nemotron-test", "prompt": "hi", "max_tokens": 2, **body}
    with httpx.Client(timeout=30.0) as client:
        return client.post(url + "/v1/completions", json=payload)


def _stream_quietly(url: str) -> None:
    try:
        _complete(url, max_tokens=400, stream=True, fake_token_delay=0.05)
    except httpx.HTTPError:
        pass


@pytest.fixture
def gateway(engine: FakeEngineControl, redis_clean: str) -> Iterator[tuple[ServerProcess, str]]:
    with run_gateway(engine.base_url, redis_clean, env=ENV) as proc:
        url = f"http://127.0.0.1:{proc.port}"
        # Every worker has started and learned the model: many new connections in a row all answer 200.
        wait_until(lambda: all(_ready_status(url) == 200 for _ in range(3 * WORKERS)), timeout=60)
        yield proc, url
    engine.freeze(False)


def test_a_hung_engine_core_stays_not_ready_in_every_worker_until_it_generates(
    gateway: tuple[ServerProcess, str], engine: FakeEngineControl
) -> None:
    _, url = gateway
    assert _complete(url).status_code == 200  # it generated since it came up (a cold engine is given time)
    # Streams in flight in some workers when the engine core hangs: a worker judging alone would wait the stall
    # timeout for them while its idle siblings already refuse.
    streams = [threading.Thread(target=_stream_quietly, args=(url,)) for _ in range(6)]
    for stream in streams:
        stream.start()
    time.sleep(0.5)
    engine.freeze()  # /health keeps answering 200; no token leaves
    wait_until(lambda: _ready_status(url) == 503, timeout=30, message="a hung engine core never turned /ready 503")
    answers = []
    deadline = time.monotonic() + 5.0  # past the stall timeout, several generation probes and /health 200s
    while time.monotonic() < deadline:
        answers.append(_ready_status(url))
    assert answers.count(503) == len(answers), f"/ready answered {sorted(set(answers), key=str)} while hung"
    assert _complete(url).status_code == 503
    for stream in streams:
        stream.join(timeout=30)  # ended by the gateway, with an error event
    engine.freeze(False)
    wait_until(lambda: _ready_status(url) == 200, timeout=30, message="never ready again once it generated")
    assert [_ready_status(url) for _ in range(3 * WORKERS)] == [200] * (3 * WORKERS)
    assert _complete(url).status_code == 200


def test_the_idle_generation_probe_is_sent_once_per_gateway_per_interval(
    gateway: tuple[ServerProcess, str], engine: FakeEngineControl
) -> None:
    started = time.monotonic()
    before = engine.stats()["generation_probes"]
    # An idle gateway probes when it has seen the engine quiet for a probe interval: it does probe...
    wait_until(lambda: engine.stats()["generation_probes"] - before >= 3, timeout=60, message="no idle probes")
    probes = engine.stats()["generation_probes"] - before
    # ...and at most once per interval over the window the two reads span (one per worker would be twelve).
    window = time.monotonic() - started
    assert probes <= window / PROBE_INTERVAL + 1, (probes, round(window, 2))


def test_a_stop_signal_to_the_pool_turns_every_worker_not_ready_at_once(
    gateway: tuple[ServerProcess, str],
) -> None:
    proc, url = gateway
    stop_load = threading.Event()

    def load() -> None:  # streams in flight in the workers while the stop signal arrives
        while not stop_load.is_set():
            try:
                _complete(url, max_tokens=10, stream=True, fake_token_delay=0.02)
            except httpx.HTTPError:
                return

    loaders = [threading.Thread(target=load) for _ in range(6)]
    for loader in loaders:
        loader.start()
    try:
        time.sleep(1.0)
        os.kill(proc.pid, signal.SIGTERM)  # the pool parent alone, as systemd or `nemotron-gateway up` stop it
        # The parent logs this once its signal handler has marked the pool draining, before it signals any worker:
        # from then on every worker is not ready, however late each gets its own signal (no race with the clock).
        wait_until(lambda: "worker processes (drain up to" in proc.log_text(), timeout=30)
        answers = [_ready_status(url) for _ in range(6 * WORKERS)]
    finally:
        stop_load.set()
        for loader in loaders:
            loader.join(timeout=30)
    assert set(answers) <= {503, None}, f"after the pool began to stop, a worker still said ready: {answers}"
    wait_until(lambda: not proc.running, timeout=60, message="the gateway did not stop after one SIGTERM")
    assert proc.stop() == 0


@pytest.mark.parametrize(("log_probes", "logged"), [(None, False), ("true", True)])
def test_probes_are_access_logged_only_when_asked(
    engine: FakeEngineControl, redis_clean: str, log_probes: str | None, logged: bool
) -> None:
    env = {"NEMOTRON_AUTH__ENABLED": "false"}
    if log_probes is not None:
        env["NEMOTRON_LOG_PROBES"] = log_probes
    with run_gateway(engine.base_url, redis_clean, env=env) as proc:
        url = f"http://127.0.0.1:{proc.port}"
        with httpx.Client(base_url=url, timeout=10.0) as client:
            assert client.get("/health").status_code == 200
            assert client.get("/ready").status_code == 200
            assert client.get("/v1/models", headers={"X-Request-ID": "after-the-probes"}).status_code == 200
            metrics = client.get("/metrics").text
        log = wait_until(lambda: proc.log_text() if "after-the-probes" in proc.log_text() else None, timeout=10)
    access = [line for line in log.splitlines() if "gateway.access" in line]
    assert any('"GET /health"' in line for line in access) is logged
    assert any('"GET /ready"' in line for line in access) is logged
    # Counted either way.
    assert 'nemotron_gateway_requests_total{route="/health",status="200"}' in metrics
    assert 'nemotron_gateway_requests_total{route="/ready",status="200"}' in metrics
