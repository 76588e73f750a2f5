"""EngineMonitor: the gateway's own cached view of the engine (health probe, served model, context length).

Requests are refused with a fast 503 while the engine is known to be down, instead of each one
waiting on a hung engine. Imports settings, errors, metrics, the model facts and the client.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from gateway.errors import EngineUnavailableError, GatewayError
from gateway.metrics import GatewayMetrics
from gateway.relay.client import EngineClient
from gateway.relay.model import ModelInfo
from gateway.settings import Settings

logger = logging.getLogger(__name__)


class EngineMonitor:
    """Probes the engine's /health on an interval and remembers what the engine serves."""

    def __init__(self, client: EngineClient, settings: Settings, metrics: GatewayMetrics) -> None:
        self._client = client
        self._settings = settings
        self._metrics = metrics
        self._task: asyncio.Task[None] | None = None
        self.down_reason: str | None = "not probed yet"
        self.model: ModelInfo | None = None

    async def start(self) -> None:
        """Probe once now (so the first requests know), then keep probing in the background."""
        await self.check()
        self._task = asyncio.create_task(self._run(), name="engine-monitor")

    async def stop(self) -> None:
        """Stop probing."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._settings.relay.probe_interval)
            await self.check()

    async def check(self) -> str | None:
        """Probe now; returns None when the engine is ready, else why not (also cached for requests)."""
        reason = await self._client.probe(self._settings.relay.probe_timeout)
        if reason is None and self.model is None:
            try:
                listing = await self._client.get_json("/v1/models", self._settings.relay.probe_timeout)
                self.model = ModelInfo.from_listing(listing, self._settings)
                logger.info("engine serves %r (context length %s)", self.model.name, self.model.context_length)
            except GatewayError as exc:
                reason = exc.message
        self._set(reason)
        return reason

    def mark_down(self, reason: str) -> None:
        """A request found the engine unreachable: refuse fast until the next probe succeeds."""
        self._set(reason)

    def _set(self, reason: str | None) -> None:
        if reason != self.down_reason:
            if reason is None:
                logger.info("engine is ready")
            else:
                logger.warning("engine is not ready: %s", reason)
                # The engine may come back as another model or context length (a restart).
                self.model = None
        self.down_reason = reason
        self._metrics.engine_up.set(0 if reason else 1)

    def require_ready(self) -> ModelInfo:
        """The served model, or EngineUnavailableError (503 + Retry-After) while the engine is down."""
        if self.down_reason is not None or self.model is None:
            raise EngineUnavailableError(
                f"The model engine is not ready ({self.down_reason or 'model unknown'}); retry shortly.",
                retry_after=self._settings.relay.retry_after,
            )
        return self.model
