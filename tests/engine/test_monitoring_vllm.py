"""The shipped scrape config and priority scheduling against the real `vllm serve` (CPU build, demo model) under
`nemotron-gateway up`, one engine start with `--scheduling-policy priority` (cpu-dev + NEMOTRON_ENGINE__EXTRA_ARGS,
as an operator would) and admission on:
- vLLM's own metrics reach a real Prometheus through the gateway's /metrics/engine relay, as their own job, and the
  dashboard's engine panels have data;
- the supervisor records the policy it launched, the gateway learns it and sends the key's priority, and vLLM
  serves it.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from deploy.grafana.dashboard import load_dashboard, panel_queries
from tests.engine.conftest import CACHE_ROOT
from tests.engine.stacks import gateway_cli, running_up, up_settings
from tests.integration.test_monitoring import PROMETHEUS_DIR, _prometheus, _scrape_config
from tests.procs import free_port, wait_until

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

# What the issue names: queue, KV cache, prefix cache, vLLM's TTFT, ITL and queue-time histograms, preemptions.
VLLM_SERIES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:request_queue_time_seconds_bucket",
    "vllm:num_preemptions_total",
)


def _query(prometheus: str, expr: str) -> list[dict[str, Any]]:
    answer = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=10)
    answer.raise_for_status()
    result: list[dict[str, Any]] = answer.json()["data"]["result"]
    return result


@dataclass
class Stack:
    gateway: str
    engine: str
    env: dict[str, str]
    prometheus: str


@pytest.fixture(scope="module")
def stack(demo_model_dir: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    workdir = tmp_path_factory.mktemp("vllm-monitoring")
    engine_port, gateway_port, supervisor_port = free_port(), free_port(), free_port()
    state_dir = CACHE_ROOT / "engine-tests-monitoring"
    env = up_settings(
        demo_model_dir, redis_url, engine_port=engine_port, gateway_port=gateway_port, state_dir=state_dir
    )
    env["NEMOTRON_ENGINE__METRICS_PORT"] = str(supervisor_port)
    env["NEMOTRON_ENGINE__EXTRA_ARGS"] = '["--scheduling-policy","priority"]'
    # Admission on, with room: the engine's gauges are read and published on every probe.
    env["NEMOTRON_ADMISSION__MAX_WAITING"] = "64"
    rules = Path(workdir / "alerts.yml")
    rules.write_text((PROMETHEUS_DIR / "alerts.yml").read_text())
    with (
        # A daily budget, so the dashboard's budget panel has a key to show.
        running_up(env, key_prefix="monitoring", rpm=0, tpm=0, key_flags=("--daily-tokens", "1000000")) as (proc, key),
        _prometheus(_scrape_config(gateway_port, supervisor_port, rules), workdir / "prom") as url,
    ):
        try:
            _traffic(gateway_port, key)
        except openai.APIError as exc:
            pytest.fail(f"{exc}; the stack's output:\n{proc.tail(200)}", pytrace=False)
        yield Stack(f"http://127.0.0.1:{gateway_port}", f"http://127.0.0.1:{engine_port}", env, url)


@pytest.fixture
def prometheus(stack: Stack) -> str:
    return stack.prometheus


def _traffic(gateway_port: int, key: str) -> None:
    """Non-stream and streamed chats (a repeated prompt can hit vLLM's prefix cache)."""
    with openai.OpenAI(base_url=f"http://127.0.0.1:{gateway_port}/v1", api_key=key, max_retries=0) as sdk:
        for prompt in ("Hello there", "Hello there", "Tell me"):
            sdk.chat.completions.create(
                model="nemotron", messages=[{"role": "user", "content": prompt}], max_tokens=8, timeout=120
            )
            chunks = sdk.chat.completions.create(
                model="nemotron", messages=[{"role": "user", "content": prompt}], max_tokens=8, stream=True
            )
            list(chunks)


def test_vllm_metrics_reach_prometheus_through_the_gateway(prometheus: str) -> None:
    def missing() -> list[str]:
        return [name for name in VLLM_SERIES if not _query(prometheus, f'{name}{{job="nemotron-engine"}}')]

    wait_until(lambda: not missing(), timeout=60, interval=1.0, message=f"missing in Prometheus: {missing()}")

    def first_tokens() -> float:
        ttft = _query(prometheus, 'sum(vllm:time_to_first_token_seconds_count{job="nemotron-engine"})')
        return float(ttft[0]["value"][1]) if ttft else 0.0

    # Every request's first token, as vLLM measured it; the scrape that found the series may have come
    # while the traffic ran, so wait for a later one.
    wait_until(lambda: first_tokens() >= 6, timeout=60, interval=1.0, message=f"first tokens: {first_tokens()}")


def test_every_panel_but_the_gpus_has_data_on_the_real_engine(prometheus: str) -> None:
    queries = [q for q in panel_queries(load_dashboard()) if "_gpu_" not in q.expr]
    # Panels that need a refusal or a failure the real-engine run does not cause.
    quiet = ("rate_limited", "auth_failures", "engine_errors", "client_disconnects", "redis_errors", 'status!~"2.."')

    def empty() -> list[str]:
        return [q.expr for q in queries if not any(n in q.expr for n in quiet) and not _query(prometheus, q.expr)]

    # The message is read at the deadline: what was still empty then, not before the first scrape.
    try:
        wait_until(lambda: not empty(), timeout=60, interval=1.0)
    except AssertionError:
        pytest.fail(f"panels without data: {empty()}", pytrace=False)


def test_a_priority_5_key_is_served_by_vllm_under_priority_scheduling(stack: Stack) -> None:
    status = json.loads((Path(stack.env["NEMOTRON_ENGINE__STATE_DIR"]) / "engine.json").read_text())
    assert status["scheduling_policy"] == "priority"
    name = f"engine-batch-{uuid.uuid4().hex[:8]}"
    created = gateway_cli(stack.env, "keys", "create", "--name", name, "--priority", "5")
    assert created.returncode == 0, created.stderr
    headers = {"Authorization": f"Bearer {created.stdout.strip().splitlines()[-1]}"}
    try:
        body = {"model": "nemotron", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        response = httpx.post(f"{stack.gateway}/v1/chat/completions", json=body, headers=headers, timeout=120)
        assert response.status_code == 200, response.text
        # vLLM itself takes a non-zero priority under this policy.
        direct = httpx.post(
            f"{stack.engine}/v1/completions",
            json={"model": "nemotron", "prompt": "Hi", "max_tokens": 1, "priority": 5},
            timeout=120,
        )
        assert direct.status_code == 200, direct.text
        metrics = httpx.get(f"{stack.gateway}/metrics", timeout=10).text
        assert re.search(
            r'^nemotron_gateway_priority_sent_total\{field="sent",model="nemotron",replica="[^"]+",tier="2"\} [1-9]',
            metrics,
            re.M,
        )
        # The engine's load as vLLM's own gauges say, published by the monitor's scrape.
        wait_until(
            lambda: re.search(
                r'^nemotron_gateway_engine_load\{[^}]*figure="running"',
                httpx.get(f"{stack.gateway}/metrics").text,
                re.M,
            ),
            timeout=10,
        )
    finally:
        gateway_cli(stack.env, "keys", "revoke", name)
