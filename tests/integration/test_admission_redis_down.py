"""Admission while Redis is unreachable: fail closed (503), or admit with NEMOTRON_LIMITS__FAIL_OPEN."""

from __future__ import annotations

import pytest

from gateway.errors import KeyStoreUnavailableError
from gateway.metrics.instruments import GatewayMetrics
from gateway.ratelimit import EngineAdmission
from gateway.redis import close_redis, connect_redis
from gateway.settings import Settings
from tests.procs import free_port

pytestmark = pytest.mark.timeout(20)


@pytest.mark.parametrize("fail_open", [False, True])
async def test_admission_without_redis_follows_the_limits_fail_open(fail_open: bool) -> None:
    settings = Settings(
        redis_url=f"redis://127.0.0.1:{free_port()}/0",  # nothing listens there
        admission={"max_waiting": 8},
        limits={"fail_open": fail_open},
    )
    redis = connect_redis(settings)
    try:
        admission = EngineAdmission(redis, settings, GatewayMetrics())
        if fail_open:
            await admission.admit(0)
        else:
            with pytest.raises(KeyStoreUnavailableError):
                await admission.admit(0)
    finally:
        await close_redis(redis)
