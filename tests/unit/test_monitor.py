"""EngineMonitor's readiness rules against a tiny in-process engine (aiohttp.web) whose /health and generation
can be made late, failing or frozen: down only on a refused connection, a non-200 /health or a stuck engine."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aiohttp import web

from gateway.engine.supervisor_state import STATUS_FILE, EngineStatus
from gateway.errors import EngineUnavailableError
from gateway.metrics.instruments import GatewayMetrics
from gateway.relay import monitor as monitor_module
from gateway.relay.activity import EngineActivity
from gateway.relay.client import EngineClient
from gateway.relay.monitor import NOT_GENERATING, EngineMonitor
from gateway.relay.readiness import SharedEngineState
from gateway.settings import Settings
from tests.procs import async_wait_until, free_port

pytestmark = pytest.mark.timeout(20)


@dataclass
class Engine:
    health_status: int = 200
    health_delay: float = 0.0
    generation_delay: float = 0.0
    generation_status: int = 200
    generations: int = 0
    health_calls: int = 0
    models_status: int = 200
    models_delay: float = 0.0
    aborted: list[str] = field(default_factory=list)

    async def health(self, request: web.Request) -> web.Response:
        self.health_calls += 1
        await asyncio.sleep(self.health_delay)
        return web.Response(status=self.health_status)

    async def models(self, request: web.Request) -> web.Response:
        await asyncio.sleep(self.models_delay)
        if self.models_status != 200:
            return web.json_response({"error": "Unauthorized"}, status=self.models_status)
        return web.json_response({"data": [{"id": "m", "max_model_len": 64}]})

    async def completions(self, request: web.Request) -> web.Response:
        self.generations += 1
        await asyncio.sleep(self.generation_delay)
        return web.json_response({"choices": []}, status=self.generation_status)


class Waiting:
    """An exchange in flight, as the relay registers it."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def abort_frozen(self) -> None:
        self.engine.aborted.append("ended")


@dataclass
class Rig:
    engine: Engine
    monitor: EngineMonitor
    activity: EngineActivity


@pytest.fixture
async def served() -> AsyncIterator[tuple[Engine, str]]:
    """The test engine, listening; and its URL."""
    engine = Engine()
    app = web.Application()
    app.router.add_get("/health", engine.health)
    app.router.add_get("/v1/models", engine.models)
    app.router.add_post("/v1/completions", engine.completions)
    runner = web.AppRunner(app, shutdown_timeout=0.1, handler_cancellation=True)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield engine, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def _monitoring(url: str, activity: EngineActivity, probe_interval: float) -> AsyncIterator[EngineMonitor]:
    relay = {"probe_interval": probe_interval, "probe_timeout": 0.2, "generation_probe_timeout": 0.3}
    settings = Settings(engine_url=url, relay={**relay, "stall_timeout": 1.0})
    client = EngineClient(settings)
    await client.start()
    monitor = EngineMonitor(client, settings.relay, GatewayMetrics(), activity, state_dir=settings.engine.state_dir)
    await monitor.start()
    try:
        yield monitor
    finally:
        await monitor.stop()
        await client.stop()


@pytest.fixture
async def rig(served: tuple[Engine, str]) -> AsyncIterator[Rig]:
    engine, url = served
    activity = EngineActivity()
    async with _monitoring(url, activity, 0.1) as monitor:
        yield Rig(engine, monitor, activity)


@pytest.fixture
async def workers(served: tuple[Engine, str]) -> AsyncIterator[tuple[Engine, EngineMonitor, EngineMonitor]]:
    """Two gateway workers' monitors of one engine, sharing one engine view; the first holds the probe turn (it
    started first), and each checks only when a test says (no periodic check in the test's time)."""
    engine, url = served
    shared = SharedEngineState()
    async with (
        _monitoring(url, EngineActivity(shared), 3600) as first,
        _monitoring(url, EngineActivity(shared), 3600) as second,
    ):
        yield engine, first, second


async def test_a_late_health_alone_never_makes_the_engine_unready(rig: Rig) -> None:
    assert rig.monitor.ready_reason() is None
    rig.engine.health_delay = 1.0  # five times the probe timeout
    for _ in range(4):
        assert await rig.monitor.check() is None
    assert rig.engine.generations >= 1, "idle, so its generation was checked instead"


async def test_health_answering_non_200_is_down_with_a_short_reason(rig: Rig) -> None:
    rig.engine.health_status = 503
    assert await rig.monitor.check() == "/health answered 503"
    with pytest.raises(Exception, match=r"^The model engine is not ready \(/health answered 503\); retry shortly\.$"):
        await rig.monitor.require_ready()
    rig.engine.health_status = 200
    assert await rig.monitor.check() is None


async def test_idle_engine_that_does_not_generate_is_stuck_until_it_generates_again(rig: Rig) -> None:
    await async_wait_until(lambda: rig.engine.generations >= 1, within=5)  # it generated once: warmed up
    await asyncio.sleep(0.2)
    rig.engine.generation_delay = 5.0  # the generation probe times out; /health still 200
    await async_wait_until(lambda: rig.monitor.ready_reason() == NOT_GENERATING, within=10)
    rig.engine.generation_delay = 0.0
    await async_wait_until(lambda: rig.monitor.ready_reason() is None, within=10)


async def test_a_failing_generation_probe_while_chunks_flow_changes_nothing(rig: Rig) -> None:
    rig.engine.generation_delay = 5.0
    waiting = Waiting(rig.engine)
    rig.activity.begin(waiting)
    for _ in range(20):  # 2 s of a busy engine streaming, well past the probe timeout and the stall timeout
        rig.activity.progress()
        await asyncio.sleep(0.1)
        rig.activity.last_progress -= 0.15  # quiet just past the probe interval: probes do run
    assert rig.monitor.ready_reason() is None
    assert rig.engine.aborted == []


async def test_busy_engine_without_progress_is_stuck_after_the_stall_timeout_and_its_requests_end(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    rig.engine.generation_delay = 5.0
    waiting = Waiting(rig.engine)
    rig.activity.begin(waiting)
    rig.activity.progress()
    await async_wait_until(lambda: rig.monitor.ready_reason() == NOT_GENERATING, within=10)
    # Not before the stall timeout while requests are in flight: the quiet the monitor judged on, as it logged it
    # (its own clock, read when it decided; the test's reading of the time would race a busy machine).
    judged = [r.args for r in caplog.records if r.getMessage().startswith("engine is not generating: no progress")]
    assert judged and all(isinstance(a, tuple) and a[0] >= 1.0 for a in judged), judged
    assert rig.engine.aborted == ["ended"]
    assert rig.activity.in_flight == 0


async def test_a_cold_engine_whose_first_generations_are_slow_is_not_stuck(rig: Rig) -> None:
    rig.monitor.mark_refused()  # as after a restart
    rig.engine.generation_delay = 5.0
    assert await rig.monitor.check() is None
    await asyncio.sleep(1.0)  # probes started and timed out
    assert rig.engine.generations >= 1
    assert rig.monitor.ready_reason() is None


async def test_refused_generation_probe_or_health_is_connection_refused(rig: Rig) -> None:
    rig.monitor.mark_refused()
    assert rig.monitor.ready_reason() == "connection refused"
    assert await rig.monitor.check() is None, "a /health 200 clears it"


async def test_two_workers_give_one_verdict_and_only_the_turn_holder_probes(
    workers: tuple[Engine, EngineMonitor, EngineMonitor],
) -> None:
    engine, first, second = workers
    probes = engine.health_calls
    engine.health_status = 503
    # The first holds the probe turn: the second does not probe, it answers what the first last found.
    assert await second.check() is None
    assert engine.health_calls == probes
    assert await first.check() == "/health answered 503"
    assert second.ready_reason() == "/health answered 503", "what the first found, the second answers"
    engine.health_status = 200
    assert await first.check() is None
    model = await second.require_ready()  # what /ready's 200 promised: the second worker serves too
    assert model.name == "m"
    assert second.ready_reason() is None
    assert engine.health_calls == probes + 2


async def test_a_refusal_seen_by_one_worker_refuses_in_every_worker_until_the_prober_sees_it_back(
    workers: tuple[Engine, EngineMonitor, EngineMonitor],
) -> None:
    _, first, second = workers
    second.mark_refused()  # as the relay does on a refused connection
    with pytest.raises(EngineUnavailableError, match=r"\(connection refused\)"):
        await first.require_ready()
    reasons = [await second.confirmed_reason() for _ in range(100)]  # e.g. a load balancer asking /ready
    assert reasons == ["connection refused"] * 100
    assert await first.check() is None
    assert await second.confirmed_reason() is None


async def test_a_worker_that_does_not_learn_the_model_in_time_refuses_then_serves(
    workers: tuple[Engine, EngineMonitor, EngineMonitor], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, first, second = workers
    monkeypatch.setattr(monitor_module, "CONFIRM_WAIT", 0.02)
    second.mark_refused()
    engine.models_delay = 0.15  # under the probe timeout: the model is learned after the request gave up
    assert await first.check() is None
    with pytest.raises(EngineUnavailableError, match=r"\(model unknown\)"):
        await second.require_ready()
    await async_wait_until(lambda: second.ready_reason() is None, within=5)


async def test_the_turn_passes_to_another_worker_when_its_holder_stops_renewing_it(
    served: tuple[Engine, str],
) -> None:
    engine, url = served
    shared = SharedEngineState()
    async with _monitoring(url, EngineActivity(shared), 0.1) as first:
        probes = engine.health_calls
        async with _monitoring(url, EngineActivity(shared), 0.1) as second:
            await asyncio.sleep(0.5)
            assert engine.health_calls - probes <= 7, "one worker probes /health every 0.1 s, not two"
        await first.stop()  # the holder stops: its lease (0.4 s) runs out and the other takes the turn
        async with _monitoring(url, EngineActivity(shared), 0.1) as third:
            engine.health_status = 503
            await async_wait_until(lambda: third.ready_reason() == "/health answered 503", within=5)
    assert second.ready_reason() == "/health answered 503"


async def test_an_engine_refusing_the_gateways_key_is_not_ready_and_says_why(
    served: tuple[Engine, str], caplog: pytest.LogCaptureFixture
) -> None:
    engine, url = served
    engine.models_status = 401
    async with _monitoring(url, EngineActivity(), 3600) as monitor:
        assert monitor.ready_reason() == "engine key refused"
    assert any("NEMOTRON_ENGINE_API_KEY" in r.getMessage() for r in caplog.records if r.levelname == "ERROR")


async def test_the_policy_is_read_again_only_when_the_supervisor_rewrote_its_status(
    served: tuple[Engine, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, url = served
    reads = 0
    read = monitor_module.launched_policy

    def counted(path: Path) -> str:
        nonlocal reads
        reads += 1
        return read(path)

    monkeypatch.setattr(monitor_module, "launched_policy", counted)
    relay = {"probe_interval": 0.05, "probe_timeout": 0.2, "generation_probe_timeout": 0.3}
    settings = Settings(engine_url=url, relay=relay, engine={"state_dir": tmp_path})
    EngineStatus(scheduling_policy="fcfs").write(tmp_path / STATUS_FILE)
    client = EngineClient(settings)
    await client.start()
    monitor = EngineMonitor(client, settings.relay, GatewayMetrics(), EngineActivity(), state_dir=tmp_path)
    await monitor.start()
    try:
        await asyncio.sleep(0.5)  # ten ticks
        assert reads == 1 and not monitor.priority_scheduling
        EngineStatus(scheduling_policy="priority").write(tmp_path / STATUS_FILE)  # a restart under another policy
        await async_wait_until(lambda: monitor.priority_scheduling, within=2)
        assert reads == 2
    finally:
        await monitor.stop()
        await client.stop()
