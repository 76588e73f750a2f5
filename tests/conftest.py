"""Shared fixtures: a Redis to test against (never skipped) and the fake vLLM engine."""

from __future__ import annotations

import gc
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


# Under pytest-xdist (`-n N --dist loadgroup`, scripts/test) the tests of one group run on one worker, in order.
# The real-vLLM tier is two groups, two chains of engine starts of about the same length (the tier alone on the
# 2-core machine, two workers: 6:56), collected first so they are handed out first: as one chain it was the
# longest pole of the suite, its last minutes alone on the machine. Every other module is a group of its own (its module
# fixtures start once), except the modules whose fake engines make /dev/shm files (`--spawn-child`) and that count
# them by name before and after (another worker's would add some): those share one group, so none runs beside
# another. Groups go by path, as the scheduler sees only node ids.
ENGINE_GROUP = "real-vllm"
ENGINE_PATHS = ("tests/engine/", "tests/loadtest/test_profiles.py")
# The modules of the second chain; the rest of ENGINE_PATHS is ENGINE_GROUP.
SECOND_ENGINE_GROUP = "real-vllm-2"
# The pool's module (three engines and their restarts under load) runs in this chain, before test_stack.py and
# never beside it: in one of the two fresh-clone runs that had them side by side, vLLM finished a gone client's whole
# generation before the disconnect reached it (test_stack.py's disconnect test); the CPU they share is the likely
# cause, not proven.
SECOND_ENGINE_MODULES = frozenset(
    {
        "tests/engine/test_stack.py",
        "tests/engine/test_monitoring_vllm.py",
        "tests/engine/test_nemotron_h_preset.py",
        "tests/engine/test_pool_vllm.py",
    }
)
ENGINE_GROUPS = frozenset({ENGINE_GROUP, SECOND_ENGINE_GROUP})
SHM_COUNTING_GROUP = "fake-engine-shm"
SHM_COUNTING_MODULES = frozenset(
    {
        "tests/e2e/test_reaper_idle.py",
        "tests/e2e/test_supervisor.py",
        "tests/e2e/test_supervisor_faults.py",
        "tests/e2e/test_supervisor_processes.py",
        "tests/faults/test_engine_faults.py",
    }
)


def xdist_group_of(nodeid: str) -> str:
    """The xdist group of the test `nodeid` (see ENGINE_GROUP)."""
    module = nodeid.split("::", 1)[0]
    if module.startswith(ENGINE_PATHS):
        return SECOND_ENGINE_GROUP if module in SECOND_ENGINE_MODULES else ENGINE_GROUP
    return SHM_COUNTING_GROUP if module in SHM_COUNTING_MODULES else module


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadgroup` with our groups: xdist's own reads `xdist_group` marks from node ids, which it can no
    longer rewrite under pytest 9."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group_of(nodeid)

    config.option.loadscopereorder = False  # the collection order: the real-vLLM tier first
    return GroupScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In an xdist worker (where collection happens; it has `workerinput`), collect the real-vLLM tier first. A test
    marked `engine` outside ENGINE_PATHS would run beside its chains: it is refused."""
    if not hasattr(config, "workerinput"):
        return
    for item in items:
        if item.get_closest_marker("engine") is not None and xdist_group_of(item.nodeid) not in ENGINE_GROUPS:
            raise pytest.UsageError(f"{item.nodeid} is marked engine: add its module to ENGINE_PATHS in {__file__}")
    # Stable: the order within a group stays.
    items.sort(key=lambda item: xdist_group_of(item.nodeid) not in ENGINE_GROUPS)


def _xdist_workers() -> int:
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """$NEMOTRON_TEST_REDIS_URL, else 127.0.0.1:6379 db 15 if it answers, else a private redis-server.

    Under several xdist workers each starts a private redis-server: the tests flush their db, and two workers
    sharing one would wipe each other's keys.
    """
    configured = os.environ.get(REDIS_URL_ENV)
    shared_ok = _xdist_workers() == 1
    if configured and shared_ok:
        if not redis_answers(configured):
            pytest.fail(f"{REDIS_URL_ENV}={configured} does not answer PING", pytrace=False)
        yield configured
        return
    if shared_ok and os.environ.get(REDIS_PRIVATE_ENV) != "1" and redis_answers(LOCAL_REDIS_URL):
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


@pytest.fixture(scope="module", autouse=True)
def _collected_at_module_end() -> Iterator[None]:
    """Collect garbage as each module ends: an object a module left open (a socket, a Redis connection) warns when
    collected, and the warnings fail as errors (`filterwarnings`); collected here, they fail the module that leaked
    it, not whichever test runs when the collector happens to."""
    yield
    gc.collect()
