"""FailedAuthGuard: a client address that keeps failing authentication gets 429 for a while.

Imports errors, settings, metrics and gateway.redis. The address is resolved by the app (uvicorn's forwarded-allow-ips),
not here. The guard is a brake, not a gate: if Redis is down it lets requests through, and authentication fails
closed. A block stops guessing, not the address: keys that already authenticated in this process keep working
from a blocked address (everyone behind one NAT), see `KeyStore.authenticate(known_only=True)`.
Checking costs no Redis call (the hot path keeps its one round trip): failures are counted in Redis, and a
block, once decided, is published to every gateway process, which keeps it in memory. A process that
missed the message learns the block from the next failure of that address (the count script returns it).
"""

from __future__ import annotations

import logging
import math
import time

import redis.asyncio as redis_asyncio

from gateway.errors import AddressBlockedError, KeyStoreUnavailableError
from gateway.metrics.instruments import GatewayMetrics
from gateway.redis import DirectScript, PubSubListener, RedisCalls
from gateway.settings import Settings

logger = logging.getLogger(__name__)

_PREFIX = "nemotron:authfail:"
_BLOCKS_CHANNEL = "nemotron:authfail:blocks"
_MAX_REMEMBERED = 10_000

# KEYS: failure counter, block flag. ARGV: window ms, limit, block ms. Returns the block in ms, or 0.
_RECORD_FAILURE = """
local blocked = redis.call('PTTL', KEYS[2])
if blocked > 0 then return blocked end
local failures = redis.call('INCR', KEYS[1])
if failures == 1 then redis.call('PEXPIRE', KEYS[1], ARGV[1]) end
if failures >= tonumber(ARGV[2]) then
  redis.call('SET', KEYS[2], '1', 'PX', ARGV[3])
  redis.call('DEL', KEYS[1])
  return tonumber(ARGV[3])
end
return 0
"""


class FailedAuthGuard:
    """Counts 401s per client address in Redis (shared by every process) and blocks repeat offenders."""

    def __init__(self, redis: redis_asyncio.Redis, settings: Settings, metrics: GatewayMetrics | None = None) -> None:
        self._redis = redis
        self._settings = settings.auth
        self._calls = RedisCalls(settings.redis, metrics)
        self._record = DirectScript(redis, _RECORD_FAILURE)
        # Blocks this process already knows of, so a blocked client hammering us costs no Redis call.
        self._blocked_until: dict[str, float] = {}
        self._last_warning = 0.0
        self._listener = PubSubListener(redis, _BLOCKS_CHANNEL, self._on_block, stop_timeout=self._calls.timeout + 1)

    @property
    def subscribed(self) -> bool:
        """Whether blocks decided by other processes are being received."""
        return self._listener.subscribed

    async def start(self) -> None:
        """Listen for blocks decided by any gateway process."""
        self._listener.start()

    async def stop(self) -> None:
        """Stop listening (a bounded wait, even if Redis is gone)."""
        await self._listener.stop()

    def blocked(self, address: str) -> AddressBlockedError | None:
        """The 429 for `address` while it is blocked, else None (in memory: no Redis call)."""
        until = self._blocked_until.get(address)
        if until is not None:
            now = time.monotonic()
            if until > now:
                return self._error(until - now)
            del self._blocked_until[address]
        return None

    async def check(self, address: str) -> None:
        """Raise AddressBlockedError if `address` is blocked (in memory: no Redis call)."""
        error = self.blocked(address)
        if error is not None:
            raise error

    async def record_failure(self, address: str) -> None:
        """Count one failed authentication from `address`; enough of them within the window block it."""
        args = [
            max(1, round(self._settings.failed_auth_window * 1000)),
            self._settings.failed_auth_limit,
            max(1, round(self._settings.failed_auth_block * 1000)),
        ]
        keys = [_count_key(address), _block_key(address)]
        try:
            # A retry after a lost reply may count one failure twice: the guard is a brake, that is harmless.
            blocked_ms = int(await self._calls(lambda: self._record(keys=keys, args=args)))
        except KeyStoreUnavailableError as exc:
            self._warn(exc.__cause__ or exc)
            return
        if blocked_ms > 0:
            if address not in self._blocked_until:
                logger.warning(
                    "Client %s blocked for %.0f s after repeated failed authentication", address, blocked_ms / 1000
                )
            self._block(address, blocked_ms, time.monotonic())
            message = f"{blocked_ms} {address}"
            try:
                await self._calls(lambda: self._redis.publish(_BLOCKS_CHANNEL, message))
            except KeyStoreUnavailableError as exc:
                self._warn(exc.__cause__ or exc)

    def _on_block(self, data: bytes) -> None:
        milliseconds, _, address = data.decode().partition(" ")
        if milliseconds.isdigit() and address:
            self._block(address, int(milliseconds), time.monotonic())

    def _block(self, address: str, milliseconds: int, now: float) -> None:
        if len(self._blocked_until) >= _MAX_REMEMBERED:
            self._blocked_until = {addr: until for addr, until in self._blocked_until.items() if until > now}
            if len(self._blocked_until) >= _MAX_REMEMBERED:
                return
        self._blocked_until[address] = now + milliseconds / 1000

    @staticmethod
    def _error(seconds: float) -> AddressBlockedError:
        return AddressBlockedError(
            f"Too many failed authentication attempts from this address; retry in {math.ceil(seconds)} s.",
            retry_after=seconds,
        )

    def _warn(self, exc: BaseException) -> None:
        now = time.monotonic()
        if now - self._last_warning > 10.0:
            self._last_warning = now
            logger.warning("Failed-auth guard cannot reach Redis (%s); not blocking anyone", type(exc).__name__)


def _count_key(address: str) -> str:
    return f"{_PREFIX}{{{address}}}:count"


def _block_key(address: str) -> str:
    return f"{_PREFIX}{{{address}}}:block"
