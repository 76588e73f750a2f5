"""EngineMonitor's readiness rules against a tiny in-process engine (aiohttp.web) whose /health and generation
can be made late, failing or frozen: down only on a refused connection, a non-200 /health or a stuck engine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from gateway.errors import EngineUnavailableError
from gateway.metrics import GatewayMetrics
from gateway.relay import monitor as monitor_module
from gateway.relay.activity import EngineActivity
from gateway.relay.client import EngineClient
from gateway.relay.monitor import NOT_GENERATING, EngineMonitor
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
    aborted: list[str] = field(default_factory=list)

    async def health(self, request: web.Request) -> web.Response:
        self.health_calls += 1
        await asyncio.sleep(self.health_delay)
        return web.Response(status=self.health_status)

    async def models(self, request: web.Request) -> web.Response:
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
async def rig() -> AsyncIterator[Rig]:
    engine = Engine()
    app = web.Application()
    app.router.add_get("/health", engine.health)
    app.router.add_get("/v1/models", engine.models)
    app.router.add_post("/v1/completions", engine.completions)
    runner = web.AppRunner(app, shutdown_timeout=0.1, handler_cancellation=True)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    relay = {"probe_interval": 0.1, "probe_timeout": 0.2, "generation_probe_timeout": 0.3, "stall_timeout": 1.0}
    settings = Settings(engine_url=f"http://127.0.0.1:{port}", relay=relay)
    client = EngineClient(settings)
    await client.start()
    activity = EngineActivity()
    monitor = EngineMonitor(client, settings, GatewayMetrics(), activity)
    await monitor.start()
    try:
        yield Rig(engine, monitor, activity)
    finally:
        await monitor.stop()
        await client.stop()
        await runner.cleanup()


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


async def test_busy_engine_without_progress_is_stuck_after_the_stall_timeout_and_its_requests_end(rig: Rig) -> None:
    rig.engine.generation_delay = 5.0
    waiting = Waiting(rig.engine)
    rig.activity.begin(waiting)
    rig.activity.progress()
    loop = asyncio.get_running_loop()
    started = loop.time()
    await async_wait_until(lambda: rig.monitor.ready_reason() == NOT_GENERATING, within=10)
    assert loop.time() - started >= 1.0, "not before the stall timeout while requests are in flight"
    assert rig.engine.aborted == ["ended"]
    assert rig.activity.in_flight == 0


async def test_a_cold_engine_whose_first_generations_are_slow_is_not_stuck(rig: Rig) -> None:
    rig.monitor.mark_down("connection refused")  # as after a restart
    rig.engine.generation_delay = 5.0
    assert await rig.monitor.check() is None
    await asyncio.sleep(1.0)  # probes started and timed out
    assert rig.engine.generations >= 1
    assert rig.monitor.ready_reason() is None


async def test_refused_generation_probe_or_health_is_connection_refused(rig: Rig) -> None:
    rig.monitor.mark_down("connection refused")
    assert rig.monitor.ready_reason() == "connection refused"
    assert await rig.monitor.check() is None, "a /health 200 clears it"


async def test_a_monitor_that_saw_the_engine_down_asks_again_before_refusing(rig: Rig) -> None:
    # As in a worker whose last probe failed while another worker already saw the engine come back.
    rig.monitor.mark_down("connection refused")
    model = await rig.monitor.require_ready()
    assert model.name == "m"
    assert rig.monitor.ready_reason() is None


async def test_callers_confirming_at_once_share_one_probe(rig: Rig) -> None:
    rig.engine.health_status = 503
    assert await rig.monitor.check() == "/health answered 503"
    before = rig.engine.health_calls
    rig.engine.health_delay = 0.05  # long enough for all twenty to arrive while the one probe runs
    reasons = await asyncio.gather(*(rig.monitor.confirmed_reason() for _ in range(20)))
    assert reasons == ["/health answered 503"] * 20
    assert rig.engine.health_calls - before <= 2, "one probe, or one more if the periodic one was just starting"


async def test_a_confirming_probe_that_does_not_answer_in_time_refuses(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(monitor_module, "CONFIRM_WAIT", 0.02)
    rig.monitor.mark_down("connection refused")
    rig.engine.health_delay = 0.15  # under the probe timeout: the probe succeeds, after the request gave up
    with pytest.raises(EngineUnavailableError, match="connection refused"):
        await rig.monitor.require_ready()
    await async_wait_until(lambda: rig.monitor.ready_reason() is None, within=5)


async def test_a_stuck_engine_is_refused_without_a_new_probe(rig: Rig) -> None:
    rig.monitor._stuck = True  # as judged by liveness; /health keeps answering 200
    before = rig.engine.health_calls
    assert await rig.monitor.confirmed_reason() == NOT_GENERATING
    assert rig.engine.health_calls - before <= 1, "at most the periodic probe"
