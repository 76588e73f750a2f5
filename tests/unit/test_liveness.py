"""Liveness of a ready engine from vLLM's /metrics and the idle one-token probe (engine = httpx.MockTransport)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import pytest

from gateway.engine.supervisor_state import RestartCause
from gateway.settings import EngineSettings
from gateway.supervisor.liveness import PROBE_MARK, Liveness, parse_metrics

pytestmark = pytest.mark.timeout(10)

SETTINGS = EngineSettings(port=8001, stall_timeout=15, probe_failures=3, served_model_name="nemo")
VLLM_METRICS = """# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{{engine="0",model_name="nemo"}} {gen}
vllm:prompt_tokens_total{{engine="0",model_name="nemo"}} 12.0
vllm:num_requests_running{{engine="0",model_name="nemo"}} {running}
vllm:num_requests_running{{engine="1",model_name="nemo"}} 0.0
"""


class Engine:
    """A scripted engine: what /metrics says, how the probe answers, and what was asked."""

    def __init__(self) -> None:
        self.gen, self.running = 0.0, 0.0
        self.probe_status: int | None = 200
        self.refuse = False
        self.probes: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if self.refuse:
            raise httpx.ConnectError("refused", request=request)
        if request.url.path == "/metrics":
            return httpx.Response(200, text=VLLM_METRICS.format(gen=self.gen, running=self.running))
        self.probes.append(request)
        if self.probe_status is None:
            raise httpx.ReadTimeout("no token", request=request)
        return httpx.Response(self.probe_status, json={})


@pytest.fixture
def engine() -> Engine:
    return Engine()


@pytest.fixture
async def liveness(engine: Engine) -> AsyncIterator[Liveness]:
    async with httpx.AsyncClient(transport=httpx.MockTransport(engine)) as client:
        yield Liveness(SETTINGS, client)


def test_metrics_are_summed_over_labels() -> None:
    sample = parse_metrics(VLLM_METRICS.format(gen=30.0, running=2.0))
    assert sample is not None and sample.tokens == 42.0 and sample.running == 2.0
    assert parse_metrics("# nothing of vLLM's\nprocess_cpu_seconds_total 1.0\n") is None


async def test_growing_tokens_are_progress_without_a_probe(engine: Engine, liveness: Liveness) -> None:
    engine.running = 4.0
    await liveness.check()  # first scrape: the baseline
    engine.gen = 5.0
    verdict = await liveness.check()
    assert verdict.problem is None and verdict.cause is None
    assert engine.probes == []


async def test_running_requests_without_tokens_restart_only_after_the_stall_bound(
    engine: Engine, liveness: Liveness
) -> None:
    engine.running, engine.gen = 3.0, 10.0
    await liveness.check()
    verdict = await liveness.check()
    assert verdict.problem is not None and verdict.cause is None  # within the bound: wait
    liveness.last_progress -= SETTINGS.stall_timeout
    verdict = await liveness.check()
    assert verdict.cause is RestartCause.NOT_GENERATING
    assert "3 request(s) running and no token generated; no progress for 15 s" == verdict.problem


async def test_an_idle_engine_gets_one_marked_token_of_generation(engine: Engine, liveness: Liveness) -> None:
    verdict = await liveness.check()
    assert verdict.problem is None
    (probe,) = engine.probes
    assert probe.url.path == "/v1/completions" and probe.url.query.decode() == PROBE_MARK
    assert json.loads(probe.content) == {"model": "nemo", "prompt": "ping", "max_tokens": 1, "temperature": 0}


async def test_an_idle_engine_whose_probe_times_out_is_not_generating(engine: Engine, liveness: Liveness) -> None:
    engine.probe_status = None
    liveness.last_progress -= SETTINGS.stall_timeout
    verdict = await liveness.check()
    assert verdict.cause is RestartCause.NOT_GENERATING
    assert verdict.problem is not None and "did not finish within 15 s" in verdict.problem


async def test_refused_connections_restart_after_probe_failures(engine: Engine, liveness: Liveness) -> None:
    engine.refuse = True
    first, second, third = [await liveness.check() for _ in range(3)]
    assert first.failed and first.cause is None and second.cause is None
    assert third.cause is RestartCause.UNRESPONSIVE and third.problem == "/metrics failed (ConnectError) (3/3)"


async def test_an_error_answer_to_the_probe_counts_as_a_failure(engine: Engine, liveness: Liveness) -> None:
    engine.probe_status = 500
    verdict = await liveness.check()
    assert verdict.failed and verdict.problem == "a one-token generation answered 500 (1/3)"


async def test_the_probe_carries_the_engine_api_key(engine: Engine) -> None:
    async with httpx.AsyncClient(transport=httpx.MockTransport(engine)) as client:
        verdict = await Liveness(SETTINGS, client, api_key="engine-key").check()
    assert verdict.problem is None
    (probe,) = engine.probes
    assert probe.headers["authorization"] == "Bearer engine-key"


async def test_a_probe_the_api_server_refuses_never_restarts_an_idle_engine(
    engine: Engine, liveness: Liveness, caplog: pytest.LogCaptureFixture
) -> None:
    # vLLM run with an API key the supervisor was not told: its /v1 routes answer 401, its engine is fine.
    engine.probe_status = 401
    liveness.last_progress -= SETTINGS.stall_timeout
    verdicts = [await liveness.check() for _ in range(SETTINGS.probe_failures + 2)]
    assert all(v.cause is None and not v.failed for v in verdicts)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "refused the idle generation probe (401" in warnings[0]
