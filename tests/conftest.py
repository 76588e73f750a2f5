"""Shared fixtures: a Redis to test against (never skipped) and the fake vLLM engine."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.procs import FakeEngineControl, ServerProcess, free_port, run_fake_engine

REDIS_URL_ENV = "NEMOTRON_TEST_REDIS_URL"
# Set to 1 to always start a private redis-server, e.g. when other test runs share the machine's Redis db 15.
REDIS_PRIVATE_ENV = "NEMOTRON_TEST_REDIS_PRIVATE"
LOCAL_REDIS_URL = "redis://127.0.0.1:6379/15"  # db 15: tests flush it; the machine's db 0 is left alone


def redis_answers(url: str) -> bool:
    client = redis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


def _redis_server_binary() -> str | None:
    found = shutil.which("redis-server")
    if found is not None:
        return found
    for candidate in (Path("/usr/sbin/redis-server"), Path("/usr/bin/redis-server")):
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """$NEMOTRON_TEST_REDIS_URL, else 127.0.0.1:6379 db 15 if it answers, else a private redis-server."""
    configured = os.environ.get(REDIS_URL_ENV)
    if configured:
        if not redis_answers(configured):
            pytest.fail(f"{REDIS_URL_ENV}={configured} does not answer PING", pytrace=False)
        yield configured
        return
    if os.environ.get(REDIS_PRIVATE_ENV) != "1" and redis_answers(LOCAL_REDIS_URL):
        yield LOCAL_REDIS_URL
        return
    binary = _redis_server_binary()
    if binary is None:
        pytest.fail(
            f"No Redis for the tests: set {REDIS_URL_ENV}, run one on 127.0.0.1:6379, or install redis-server",
            pytrace=False,
        )
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    argv = [binary, "--port", str(port), "--save", "", "--appendonly", "no", "--bind", "127.0.0.1"]
    with ServerProcess(argv, ready_check=lambda: redis_answers(url), port=port):
        yield url


@pytest.fixture
def redis_clean(redis_url: str) -> str:
    """The test Redis with its db flushed first."""
    client = redis.Redis.from_url(redis_url, socket_timeout=5.0, socket_connect_timeout=5.0)
    try:
        client.flushdb()
    finally:
        client.close()
    return redis_url


@pytest.fixture(scope="module")
def fake_engine() -> Iterator[FakeEngineControl]:
    """One fake vLLM engine per test module, on a free port."""
    with run_fake_engine() as process:
        yield FakeEngineControl(process)


@pytest.fixture
def engine(fake_engine: FakeEngineControl) -> FakeEngineControl:
    """The module's fake engine, reset: no recorded requests, zeroed counters, /health 200."""
    fake_engine.reset()
    return fake_engine
