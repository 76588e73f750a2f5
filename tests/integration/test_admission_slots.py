"""Reserved sequence slots in every worker: a worker that never scrapes the engine (another one holds the probe
turn) still keeps the reserve, from the supervisor's status file and the load another worker published."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from gateway.engine.supervisor_state import STATUS_FILE, EngineStatus
from gateway.errors import EngineQueueFullError
from gateway.metrics.instruments import GatewayMetrics
from gateway.ratelimit import EngineAdmission
from gateway.ratelimit.admission import EngineLoad
from gateway.redis import close_redis, connect_redis
from gateway.settings import Settings

pytestmark = pytest.mark.timeout(20)


async def test_a_worker_that_never_scrapes_keeps_the_reserve(tmp_path: Path, redis_url: str) -> None:
    EngineStatus(sequence_slots=4).write(tmp_path / STATUS_FILE)
    settings = Settings(
        redis_url=redis_url,
        engine={"state_dir": tmp_path},
        admission={"reserved_seqs": 2, "engine_id": uuid.uuid4().hex},
    )
    redis = connect_redis(settings)
    try:
        scraping, admitting = (EngineAdmission(redis, settings, GatewayMetrics()) for _ in range(2))
        # The probe-turn holder publishes what vLLM runs: two requests, nothing waiting.
        mark = await scraping.mark()
        await scraping.publish(EngineLoad(waiting=0, running=2, kv_cache_use=0.1, finished=0), mark, 1.0)
        # The other worker has never scraped: four slots less two reserved leave no room for priority 1.
        with pytest.raises(EngineQueueFullError, match="sequence slots"):
            await admitting.admit(1)
        await admitting.admit(0)  # the most urgent tier may take the reserved slots
    finally:
        await close_redis(redis)
