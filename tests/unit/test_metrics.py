"""The metrics module, the scrape access rule and the JSON access line, without sockets."""

from __future__ import annotations

import argparse
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector
from pydantic import SecretStr
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway.engine import nvml
from gateway.engine.nvml import ActivityReader
from gateway.engine.supervisor_state import EngineState, EngineStatus, RestartCause, RestartRecord
from gateway.errors import KeyStoreUnavailableError, MetricsForbiddenError
from gateway.http.middleware import RequestContextMiddleware
from gateway.metrics.exposition import ScrapeAccess
from gateway.metrics.instruments import GatewayMetrics, GpuCollector, SupervisorMetrics, WorkersCollector
from gateway.ratelimit.redis import _exhausted
from gateway.redis import RedisCalls
from gateway.request_record import EngineErrorKind, RequestRecord
from gateway.settings import HttpSettings, MetricsSettings, RedisSettings
from gateway.types import Message, Send
from tests.unit.doctor.test_gpu import FakeNvml

pytestmark = pytest.mark.timeout(10)


def _text(metrics: GatewayMetrics | SupervisorMetrics) -> str:
    return generate_latest(metrics.registry).decode()


def test_process_and_python_collectors_are_exported() -> None:
    text = _text(GatewayMetrics())
    assert "process_resident_memory_bytes" in text and "process_open_fds" in text
    assert "python_info" in text and "python_gc_collections_total" in text


def test_per_key_series_are_labelled_by_name_and_forgotten_on_revocation() -> None:
    metrics = GatewayMetrics()
    metrics.count_key("team-a", 200, 3, 4)
    metrics.count_key("team-a", 429, None, None)
    metrics.count_key("team-b", 200, 1, 1)
    sample = metrics.registry.get_sample_value
    assert sample("nemotron_gateway_key_requests_total", {"key": "team-a", "status": "429"}) == 1
    assert sample("nemotron_gateway_key_tokens_total", {"key": "team-a", "kind": "completion"}) == 4
    metrics.forget_key("team-a")
    text = _text(metrics)
    assert 'key="team-a"' not in text and 'key="team-b"' in text
    metrics.count_key("team-a", 200, 1, 1)  # a changed (not revoked) key starts again from zero
    assert sample("nemotron_gateway_key_tokens_total", {"key": "team-a", "kind": "prompt"}) == 1
    metrics.forget_key("*")
    assert "key=" not in _text(metrics)


def test_forgetting_keys_with_several_workers_warns_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Several workers (PROMETHEUS_MULTIPROC_DIR set): prometheus-client warns on each removal, which this suite
    # turns into an error; the gateway drops the other workers' series at the scrape instead.
    metrics = GatewayMetrics()
    metrics.count_key("team-a", 200, 3, 4)
    metrics.set_key_budget("team-a", 1000, 0, 10, 0)
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    metrics.forget_key("*")
    assert "team-a" not in _text(metrics)


def test_per_key_labels_can_be_turned_off() -> None:
    metrics = GatewayMetrics(per_key=False)
    metrics.count_key("team-a", 200, 3, 4)
    assert "team-a" not in _text(metrics)


@dataclass
class _Gpu:
    index: int = 0
    name: str = "NVIDIA H200"
    uuid: str = "GPU-1"
    utilization: float | None = 0.5
    memory_used: int = 10
    memory_total: int = 100
    temperature: float | None = 40.0
    power: float | None = None  # a figure the driver does not give: no sample, not a zero
    pcie_tx: float | None = 1024.0
    pcie_rx: float | None = 2048.0


def test_gpu_collector_exports_each_gpu_and_nothing_without_one() -> None:
    metrics = GatewayMetrics()
    metrics.registry.register(GpuCollector(lambda: [_Gpu(), _Gpu(index=1, uuid="GPU-2", memory_used=20)]))
    sample = metrics.registry.get_sample_value
    labels = {"gpu": "1", "name": "NVIDIA H200", "uuid": "GPU-2"}
    assert sample("nemotron_gateway_gpu_memory_used_bytes", labels) == 20
    assert sample("nemotron_gateway_gpu_utilization_ratio", {**labels, "gpu": "1"}) == 0.5
    assert sample("nemotron_gateway_gpu_pcie_receive_bytes_per_second", labels) == 2048
    assert "nemotron_gateway_gpu_power_watts{" not in _text(metrics)
    empty = GatewayMetrics()
    empty.registry.register(GpuCollector(lambda: []))
    assert "nemotron_gateway_gpu" not in _text(empty)


@pytest.mark.skipif(Path("/dev/nvidiactl").exists(), reason="this machine has an NVIDIA GPU")
def test_activity_reader_reads_nothing_without_a_gpu() -> None:
    reader = ActivityReader()
    assert reader.read() == () and reader.read() == ()  # no error, no series, every time
    reader.close()


class _ActivityNvml(FakeNvml):
    """Two H200s answering the activity calls as NVML does (percent, milliwatts, KB/s)."""

    NVML_TEMPERATURE_GPU, NVML_PCIE_UTIL_TX_BYTES, NVML_PCIE_UTIL_RX_BYTES = 0, 0, 1

    def __init__(self) -> None:
        super().__init__(count=2)

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:
        return argparse.Namespace(used=(handle + 1) * 10 * 2**30, total=141 * 2**30, free=0)

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> Any:
        return argparse.Namespace(gpu=50 + handle)

    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> int:
        return 40

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:
        return 300_000

    def nvmlDeviceGetPcieThroughput(self, handle: int, counter: int) -> int:
        return 4


def _gpu_scrape(gpus: str | None, monkeypatch: pytest.MonkeyPatch) -> dict[str, float]:
    """The memory-used series of one scrape through the NVML reader, by their `gpu` label."""
    monkeypatch.setattr(nvml, "pynvml", _ActivityNvml())
    metrics = GatewayMetrics()
    reader = ActivityReader(gpus)
    metrics.registry.register(GpuCollector(reader.read))
    family = next(f for f in metrics.registry.collect() if f.name == "nemotron_gateway_gpu_memory_used_bytes")
    reader.close()
    return {s.labels["gpu"]: s.value for s in family.samples}


def test_every_gpus_activity_is_scraped_with_its_gpu_label(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _gpu_scrape(None, monkeypatch) == {"0": 10 * 2**30, "1": 20 * 2**30}


@pytest.mark.parametrize("gpus", ["1", "GPU-1f1a"])
def test_only_the_engines_gpus_are_scraped_when_the_operator_names_them(
    gpus: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # NEMOTRON_ENGINE__GPUS bounds the `gpu` label to the engine's GPUs (by index or UUID prefix, as CUDA reads it).
    assert _gpu_scrape(gpus, monkeypatch) == {"1": 20 * 2**30}


@dataclass
class _Status:
    state: EngineState
    since: float
    restarts: int = 0
    last_exit_code: int | None = None
    history: list[RestartRecord] = field(default_factory=list)


def test_supervisor_metrics_start_up_duration_restarts_and_last_exit() -> None:
    metrics = SupervisorMetrics()

    def sample(name: str, labels: dict[str, str] | None = None) -> float | None:
        return metrics.registry.get_sample_value(name, {"replica": "0", **(labels or {})})

    metrics.observe(_Status(EngineState.STARTING, since=100.0))
    metrics.observe(_Status(EngineState.READY, since=142.5))
    assert sample("nemotron_supervisor_engine_startup_duration_seconds") == 42.5
    assert sample("nemotron_supervisor_engine_up") == 1
    crash = RestartRecord(at=150.0, cause=RestartCause.NOT_GENERATING, reason="stalled", exit_code=-9)
    metrics.observe(_Status(EngineState.RESTARTING, since=150.0, restarts=1, last_exit_code=-9, history=[crash]))
    metrics.observe(_Status(EngineState.STARTING, since=152.0, restarts=1, last_exit_code=-9, history=[crash]))
    metrics.observe(_Status(EngineState.READY, since=160.0, restarts=1, last_exit_code=-9, history=[crash]))
    assert sample("nemotron_supervisor_engine_startup_duration_seconds") == 8.0
    assert sample("nemotron_supervisor_engine_restarts_total") == 1
    assert sample("nemotron_supervisor_engine_last_exit", {"cause": "not_generating"}) == 1
    assert sample("nemotron_supervisor_engine_last_exit", {"cause": "crash"}) == 0
    assert sample("nemotron_supervisor_engine_state", {"state": "ready"}) == 1


def test_supervisor_metrics_keep_each_replica_apart() -> None:
    metrics = SupervisorMetrics()
    sample = metrics.registry.get_sample_value
    crash = RestartRecord(at=150.0, cause=RestartCause.CRASH, reason="exited", exit_code=-9)
    metrics.observe(_Status(EngineState.STARTING, since=100.0), replica="0")
    metrics.observe(_Status(EngineState.STARTING, since=101.0), replica="1")
    metrics.observe(_Status(EngineState.READY, since=110.0), replica="0")
    metrics.observe(_Status(EngineState.RESTARTING, since=150.0, restarts=1, history=[crash]), replica="1")
    assert sample("nemotron_supervisor_engine_up", {"replica": "0"}) == 1
    assert sample("nemotron_supervisor_engine_up", {"replica": "1"}) == 0
    assert sample("nemotron_supervisor_engine_startup_duration_seconds", {"replica": "0"}) == 10.0
    assert sample("nemotron_supervisor_engine_restarts_total", {"replica": "1"}) == 1
    # A replica that never restarted shows 0 rather than nothing, so a dashboard's max() has a value.
    assert sample("nemotron_supervisor_engine_restarts_total", {"replica": "0"}) == 0
    assert sample("nemotron_supervisor_engine_last_exit", {"replica": "1", "cause": "crash"}) == 1
    assert sample("nemotron_supervisor_engine_state", {"replica": "1", "state": "restarting"}) == 1


def test_supervisor_and_gateway_names_do_not_collide() -> None:
    gateway = {m.name for m in GatewayMetrics().registry.collect()}
    supervisor = {m.name for m in SupervisorMetrics().registry.collect()}
    assert not (gateway & supervisor)
    assert all(name.startswith("nemotron_supervisor_") for name in supervisor)
    assert EngineStatus().state.value == "starting"


def test_a_refusal_is_counted_under_the_first_exhausted_limit() -> None:
    # The admission script's bits (ratelimit/redis.py): 1 concurrency, 2 requests, 4 tokens, 8 too large.
    assert _exhausted(1 | 2) == "concurrency"
    assert _exhausted(2 | 4) == "requests"
    assert _exhausted(4) == "tokens" and _exhausted(8) == "tokens"


@pytest.mark.parametrize(
    ("client", "authorization", "allowed"),
    [
        ("127.0.0.1", None, True),
        ("::1", None, True),
        ("::ffff:127.0.0.1", None, True),
        ("10.1.2.3", None, True),
        ("10.2.0.1", None, False),
        ("203.0.113.9", "Bearer s3cret", True),
        ("203.0.113.9", "bearer s3cret", True),
        ("203.0.113.9", "Bearer wrong", False),
        ("203.0.113.9", "Basic s3cret", False),
        (None, None, False),
        ("not-an-address", None, False),
    ],
)
def test_scrape_access(client: str | None, authorization: str | None, allowed: bool) -> None:
    access = ScrapeAccess(
        MetricsSettings(allowed_networks="127.0.0.0/8, ::1/128, 10.1.0.0/16", token=SecretStr("s3cret"))
    )
    if allowed:
        access.check(client, authorization)
    else:
        with pytest.raises(MetricsForbiddenError):
            access.check(client, authorization)


async def _app(scope: object, receive: object, send: object) -> None:
    raise AssertionError("not called")


def test_json_access_line(caplog: pytest.LogCaptureFixture) -> None:
    metrics = GatewayMetrics()
    middleware = RequestContextMiddleware(
        _app, metrics, routes=frozenset({"/v1/chat/completions"}), http=HttpSettings(), log_format="json"
    )
    record = RequestRecord(request_id="abc", started_at=0.0, key_name="team-a", model="nemotron", stream=True)
    record.replica = "http://10.0.0.2:8000"
    record.first_chunk_at = 0.25
    record.take_usage(
        {"prompt_tokens": 5, "completion_tokens": 11, "completion_tokens_details": {"reasoning_tokens": 7}}
    )
    record.engine_error = EngineErrorKind.MID_STREAM
    record.client_disconnected = True
    scope = {"path": '/v1/chat/completions\n"x', "method": "POST", "client": ("198.51.100.1", 5000)}
    with caplog.at_level(logging.INFO, logger="gateway.access"):
        middleware._finish(scope, record, 499, 1.25)
    [line] = [json.loads(r.getMessage()) for r in caplog.records if r.name == "gateway.access"]
    assert line["request_id"] == "abc" and line["key"] == "team-a" and line["status"] == 499
    assert line["reasoning_tokens"] == 7 and line["ttft_ms"] == 250.0 and line["duration_ms"] == 1250.0
    assert line["disconnected"] is True and line["engine_error"] == "mid_stream"
    assert line["client"] == "198.51.100.1" and line["route"] == '/v1/chat/completions\n"x'
    assert "\n" not in caplog.records[-1].getMessage()  # a client's newline cannot start a forged line
    # The stream's inter-token latency: (1.25 - 0.25) s over 10 gaps.
    assert metrics.registry.get_sample_value("nemotron_gateway_inter_token_latency_seconds_sum") == pytest.approx(0.1)
    by_replica = {"model": "nemotron", "replica": "http://10.0.0.2:8000"}
    assert metrics.registry.get_sample_value(
        "nemotron_gateway_replica_inter_token_latency_seconds_sum", by_replica
    ) == pytest.approx(0.1)
    assert metrics.registry.get_sample_value(
        "nemotron_gateway_replica_request_duration_seconds_sum", by_replica
    ) == pytest.approx(1.25)


async def test_an_answer_is_counted_before_its_last_byte_goes_out() -> None:
    # A client with its whole answer that scrapes /metrics next (maybe another worker's) must find it counted.
    metrics = GatewayMetrics()
    sample = metrics.registry.get_sample_value
    ok = {"route": "/v1/completions", "status": "200"}

    async def answer(scope: object, receive: object, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{", "more_body": True})
        await send({"type": "http.response.body", "body": b"}", "more_body": False})

    seen: list[tuple[float | None, float | None]] = []

    async def wire(message: Message) -> None:
        seen.append((sample("nemotron_gateway_requests_total", ok), sample("nemotron_gateway_requests_in_flight")))

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    middleware = RequestContextMiddleware(
        answer, metrics, routes=frozenset({"/v1/completions"}), http=HttpSettings(), access_log=False
    )
    await middleware({"type": "http", "path": "/v1/completions", "method": "POST", "headers": []}, receive, wire)
    # In flight and not yet counted while the answer streams; counted, and no longer in flight, at its last byte.
    assert seen == [(None, 1.0), (None, 1.0), (1.0, 0.0)]
    assert sample("nemotron_gateway_requests_total", ok) == 1  # once, not again when the app returns


def test_refusals_are_counted_by_limit_and_cause() -> None:
    metrics = GatewayMetrics()
    middleware = RequestContextMiddleware(_app, metrics, routes=frozenset(), http=HttpSettings(), access_log=False)
    scope = {"path": "/v1/chat/completions", "method": "POST", "client": None}
    for status, cause in ((429, "tokens"), (429, "failed_auth"), (401, "missing"), (401, "unknown"), (401, "unknown")):
        record = RequestRecord(request_id="r", started_at=0.0)
        record.cause = cause
        middleware._finish(scope, record, status, 0.01)
    sample = metrics.registry.get_sample_value
    assert sample("nemotron_gateway_rate_limited_total", {"limit": "tokens"}) == 1
    assert sample("nemotron_gateway_rate_limited_total", {"limit": "failed_auth"}) == 1
    assert sample("nemotron_gateway_auth_failures_total", {"cause": "unknown"}) == 2


class _Shared(Collector):
    """What the multiprocess collector would read from the workers' files."""

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily("nemotron_gateway_key_tokens", "tokens", labels=("key", "kind"))
        family.add_metric(("revoked", "prompt"), 3)
        family.add_metric(("kept", "prompt"), 5)
        yield family


def test_workers_collector_drops_forgotten_keys_and_labels_process_figures_by_pid() -> None:
    registry = CollectorRegistry()
    registry.register(WorkersCollector(_Shared(), {"revoked"}, lambda: [os.getpid()]))
    text = generate_latest(registry).decode()
    assert 'key="revoked"' not in text and 'key="kept"' in text
    assert f'process_resident_memory_bytes{{pid="{os.getpid()}"}}' in text


async def test_redis_calls_are_timed_and_failures_counted() -> None:
    metrics = GatewayMetrics()
    calls = RedisCalls(RedisSettings(command_timeout=1.0), metrics)

    async def answers() -> str:
        return "ok"

    async def refused() -> str:
        raise RedisConnectionError("refused")

    assert await calls(answers) == "ok"
    with pytest.raises(KeyStoreUnavailableError):
        await calls(refused)  # tried twice, one failure counted
    sample = metrics.registry.get_sample_value
    assert sample("nemotron_gateway_redis_call_duration_seconds_count") == 2
    assert sample("nemotron_gateway_redis_errors_total") == 1
