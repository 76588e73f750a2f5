"""A frozen vLLM engine core on the real CPU engine: SIGSTOP of the EngineCore process only (the API server keeps
answering /health 200), the gateway refuses within its stated bound, then SIGCONT and it serves again.

The stack (supervisor, vLLM, gateway) is test_stack's fixture, started once for this module.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.engine.test_stack import MODEL, Stack, stack  # noqa: F401  # `stack` is the module's engine fixture
from tests.procs import wait_until

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]
logger = logging.getLogger(__name__)

# The gateway's defaults (RelaySettings) with test_stack's probe interval: idle bound =
# generation_probe_timeout + 2 x probe_interval.
IDLE_BOUND = 10.0 + 2 * 0.5
SLACK = 20.0  # two cores shared by vLLM, the supervisor, the gateway and the test


def _descendants(pid: int) -> list[int]:
    found: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                for child in Path(f"/proc/{pid}/task/{task}/children").read_text().split():
                    found += [int(child), *_descendants(int(child))]
    return found


def _engine_core_pid(root: int) -> int | None:
    """vLLM's EngineCore process below `root`: its cmdline is its title (comm cuts it to "VLLM::EngineCor")."""
    for pid in _descendants(root):
        with contextlib.suppress(OSError):
            if b"EngineCore" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
    return None


def _ready(running: Stack) -> int:
    """The gateway's /ready status; 0 while it does not answer (`up` may be restarting it)."""
    try:
        return httpx.get(f"{running.gateway}/ready", timeout=10).status_code
    except httpx.TransportError:
        return 0


def _wait_ready(running: Stack, status: int, within: float) -> None:
    try:
        wait_until(lambda: _ready(running) == status, timeout=within, interval=0.25)
    except AssertionError:
        try:
            last = httpx.get(f"{running.gateway}/ready", timeout=10).text
        except httpx.TransportError as exc:
            last = repr(exc)
        raise AssertionError(f"/ready not {status} within {within:g} s: {last}\n{running.proc.tail(80)}") from None


def test_frozen_engine_core_is_refused_within_the_bound_then_recovers(stack: Stack) -> None:  # noqa: F811  # the fixture
    _wait_ready(stack, 200, 120)
    # Below `nemotron-gateway up`: the supervisor, vllm serve, its EngineCore.
    core = wait_until(lambda: _engine_core_pid(stack.proc.pid), timeout=60, message="no EngineCore process")
    os.kill(core, signal.SIGSTOP)
    frozen_at = time.monotonic()
    try:
        _wait_ready(stack, 503, IDLE_BOUND + SLACK)
        took = time.monotonic() - frozen_at
        reason = httpx.get(f"{stack.gateway}/ready", timeout=10).json()["engine"]["reason"]
        # The gateway's own finding, or (if the supervisor's hang check came first) its restart of the engine.
        assert reason in ("engine not generating", "connection refused")
        try:
            engine_health: int | str = httpx.get(f"{stack.engine}/health", timeout=10).status_code
        except httpx.TransportError as exc:
            engine_health = type(exc).__name__
        with stack.sdk() as sdk, pytest.raises(openai.InternalServerError) as refused:
            sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert refused.value.status_code == 503 and "retry-after" in refused.value.response.headers
        logger.warning(
            "frozen EngineCore refused after %.1f s (bound %g s, %s); vLLM /health: %s",
            took,
            IDLE_BOUND,
            reason,
            engine_health,
        )
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(core, signal.SIGCONT)
    # Recovered by SIGCONT, or by the supervisor's restart if it judged the engine hung meanwhile.
    _wait_ready(stack, 200, 300)
    with stack.sdk() as sdk:
        answer = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert answer.choices[0].message.content is not None
