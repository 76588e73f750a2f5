"""Fixtures of the supervisor tests: a state dir, and `nemotron-gateway up` over the fake engine."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.supervised import engine_env, status, up_process
from tests.procs import ServerProcess, free_port, wait_until


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    return tmp_path / "state"


@pytest.fixture
def up_stack(state_dir: Path, redis_url: str) -> Iterator[tuple[ServerProcess, int, int]]:
    engine_port, gateway_port = free_port(), free_port()
    env = engine_env(
        state_dir,
        engine_port,
        NEMOTRON_PORT=str(gateway_port),
        NEMOTRON_REDIS_URL=redis_url,
        # Keys have their own tests; this one is about the process tree.
        NEMOTRON_AUTH__ENABLED="false",
        # The gateway's own view of the engine, refreshed often enough to see a short outage.
        NEMOTRON_RELAY__PROBE_INTERVAL="0.2",
        # Two workers, each with its own view of the engine: /ready's 200 from one must hold for the other.
        NEMOTRON_WORKERS="2",
    )
    proc = up_process(env, gateway_port)
    with proc.start():
        # The gateway probes the engine itself and may answer /ready before the supervisor's own check (every
        # 0.3 s here) has recorded the engine ready with its pid: the tests compare against that record.
        wait_until(
            lambda: status(state_dir).get("state") == "ready", timeout=10, message="the supervisor never said ready"
        )
        yield proc, engine_port, gateway_port
