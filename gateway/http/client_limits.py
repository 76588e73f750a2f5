"""ClientLimits: what one client connection may cost the gateway, shared by every connection of a server.

Read from the `http` settings (and, for the connection cap's default, the engine and Redis pool sizes); enforced
by the HTTP protocol in `gateway/http/uvicorn_internals.py`. Refusals and cut-offs are logged through `ThrottledLog`,
so a flood cannot flood the log. Imports settings only.
"""

from __future__ import annotations

import logging
import resource
import time
from dataclasses import dataclass

from gateway.settings import Settings

logger = logging.getLogger(__name__)

# File descriptors kept free beyond the engine and Redis pools: logs, the listening socket, probes.
_FD_HEADROOM = 64
# A refused or cut-off client is logged at most this often (with a count), so a flood cannot flood the log.
_LOG_EVERY = 10.0


def default_max_connections(settings: Settings) -> int:
    """The connection cap when `http.max_connections` is unset: the open-file limit less the gateway's own
    needs (engine and Redis pools, a little headroom), but at least half the limit."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    reserve = settings.relay.max_connections + settings.redis.max_connections + _FD_HEADROOM
    return max(soft - reserve, soft // 2)


class ThrottledLog:
    """Counts events of one kind and logs a warning about them at most once per `_LOG_EVERY` seconds."""

    def __init__(self, message: str) -> None:
        self._message = message
        self._count = 0
        self._logged_at = -_LOG_EVERY

    def event(self, *args: object) -> None:
        """Count one event; log the count (with `args` for the message) when the last log is old enough."""
        self._count += 1
        now = time.monotonic()
        if now - self._logged_at >= _LOG_EVERY:
            logger.warning(self._message, self._count, *args)
            self._count = 0
            self._logged_at = now


@dataclass(frozen=True, slots=True)
class ClientLimits:
    """What one client connection may cost, shared by every connection of a server."""

    max_head_bytes: int
    head_timeout: float
    body_timeout: float
    max_connections: int
    refusals: ThrottledLog
    slow_heads: ThrottledLog
    slow_bodies: ThrottledLog
    large_heads: ThrottledLog
    malformed: ThrottledLog

    @classmethod
    def from_settings(cls, settings: Settings) -> ClientLimits:
        """The limits the `http` settings set (the connection cap from the open-file limit when unset)."""
        cap = settings.http.max_connections or default_max_connections(settings)
        return cls(
            max_head_bytes=settings.http.max_head_bytes,
            head_timeout=settings.http.head_timeout,
            # The middleware answers a late body with 408 at `body_timeout`; this closes what it cannot reach.
            body_timeout=settings.http.body_timeout + 1.0,
            max_connections=cap,
            refusals=ThrottledLog(f"refused %d connection(s): the gateway holds its cap of {cap} connections"),
            slow_heads=ThrottledLog("closed %d connection(s) whose request head took longer than %g s"),
            slow_bodies=ThrottledLog("closed %d connection(s) whose request body took longer than %g s"),
            large_heads=ThrottledLog("refused %d request(s) with a head over %d bytes (431)"),
            malformed=ThrottledLog("refused %d malformed request(s) (400), the last: %s"),
        )
