"""Several gateway workers on one port: any worker's /metrics counts the requests of all of them.

Which worker answers is made the test's choice as in test_workers.py: the other one is stopped (SIGSTOP), and a
stopped process accepts nothing.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
from collections.abc import Iterator

import httpx
import pytest

from tests.integration.test_workers import _two_workers
from tests.procs import FakeEngineControl, ServerProcess, run_gateway, wait_until

pytestmark = pytest.mark.timeout(120)

ENV = {"NEMOTRON_AUTH__ENABLED": "false", "NEMOTRON_WORKERS": "2", "NEMOTRON_RELAY__PROBE_INTERVAL": "0.2"}
OK = re.compile(r'^nemotron_gateway_requests_total\{route="/v1/completions",status="200"\} ([0-9.]+)$', re.M)
IN_FLIGHT = re.compile(r"^nemotron_gateway_requests_in_flight ([0-9.]+)$", re.M)
RSS = re.compile(r'^process_resident_memory_bytes\{pid="(\d+)"\} [0-9.e+]+$', re.M)


@pytest.fixture(scope="module")
def gateway(fake_engine: FakeEngineControl, redis_url: str) -> Iterator[ServerProcess]:
    with run_gateway(fake_engine.base_url, redis_url, env=ENV) as proc:
        yield proc


@contextlib.contextmanager
def _only(serving: int, stopped: int) -> Iterator[None]:
    """`serving` takes every new connection while `stopped` is stopped."""
    os.kill(stopped, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(stopped, signal.SIGCONT)


def _complete(url: str, count: int) -> None:
    for _ in range(count):
        with httpx.Client(base_url=url, timeout=10) as client:  # a new connection each time
            body = {"model": "nemotron-test", "prompt": "hi", "max_tokens": 2}
            assert client.post("/v1/completions", json=body).status_code == 200


def _scrape(url: str) -> str:
    with httpx.Client(base_url=url, timeout=10) as client:
        return client.get("/metrics").text


def test_counts_add_up_across_workers(gateway: ServerProcess, engine: FakeEngineControl) -> None:
    url = f"http://127.0.0.1:{gateway.port}"
    a, b = wait_until(lambda: _two_workers(gateway.pid), timeout=30)
    with _only(a, stopped=b):
        _complete(url, 3)
    with _only(b, stopped=a):
        _complete(url, 5)
    for serving, stopped in ((a, b), (b, a)):
        with _only(serving, stopped=stopped):
            text = _scrape(url)
        found = OK.search(text)
        assert found is not None and float(found.group(1)) == 8, f"worker {serving} counted {found}"
        # One gauge over the living workers (the scrape itself is the one request in flight), not one per pid.
        assert IN_FLIGHT.findall(text) == ["1.0"]
        # Each living worker's own process figures, by pid.
        assert set(RSS.findall(text)) == {str(a), str(b)}
