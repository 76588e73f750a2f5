"""Priority scheduling on a real `vllm serve` (CPU build, tiny demo model), one engine start with
`--scheduling-policy priority` (cpu-dev + NEMOTRON_ENGINE__EXTRA_ARGS, as an operator would): the supervisor
records the policy it launched, the gateway learns it and sends the key's priority, and vLLM serves it."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.engine.conftest import CACHE_ROOT
from tests.engine.stacks import gateway_cli, running_up, up_settings
from tests.procs import free_port, wait_until

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

MODEL = "nemotron"
STATE_DIR = CACHE_ROOT / "engine-priority-tests"


@pytest.fixture(scope="module")
def stack(demo_model_dir: str, redis_url: str) -> Iterator[tuple[str, str, dict[str, str]]]:
    engine_port, gateway_port = free_port(), free_port()
    env = up_settings(
        demo_model_dir, redis_url, engine_port=engine_port, gateway_port=gateway_port, state_dir=STATE_DIR
    )
    env["NEMOTRON_ENGINE__EXTRA_ARGS"] = '["--scheduling-policy","priority"]'
    # Admission on, with room: the engine's gauges are read and published on every probe.
    env["NEMOTRON_ADMISSION__MAX_WAITING"] = "64"
    with running_up(env, key_prefix="engine-priority"):
        yield f"http://127.0.0.1:{gateway_port}", f"http://127.0.0.1:{engine_port}", env


def test_a_priority_5_key_is_served_by_vllm_under_priority_scheduling(stack: tuple[str, str, dict[str, str]]) -> None:
    gateway, engine, env = stack
    status = json.loads((Path(env["NEMOTRON_ENGINE__STATE_DIR"]) / "engine.json").read_text())
    assert status["scheduling_policy"] == "priority"
    name = f"engine-batch-{uuid.uuid4().hex[:8]}"
    created = gateway_cli(env, "keys", "create", "--name", name, "--priority", "5")
    assert created.returncode == 0, created.stderr
    headers = {"Authorization": f"Bearer {created.stdout.strip().splitlines()[-1]}"}
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        response = httpx.post(f"{gateway}/v1/chat/completions", json=body, headers=headers, timeout=120)
        assert response.status_code == 200, response.text
        # vLLM itself takes a non-zero priority under this policy.
        direct = httpx.post(
            f"{engine}/v1/completions",
            json={"model": MODEL, "prompt": "Hi", "max_tokens": 1, "priority": 5},
            timeout=120,
        )
        assert direct.status_code == 200, direct.text
        metrics = httpx.get(f"{gateway}/metrics", timeout=10).text
        assert re.search(r'^nemotron_gateway_priority_sent_total\{field="sent",tier="2"\} [1-9]', metrics, re.M)
        # The engine's load as vLLM's own gauges say, published by the monitor's scrape.
        wait_until(
            lambda: 'nemotron_gateway_engine_load{figure="running"}' in httpx.get(f"{gateway}/metrics").text, timeout=10
        )
    finally:
        gateway_cli(env, "keys", "revoke", name)
