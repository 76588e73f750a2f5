"""Replica: one engine of the pool and everything the gateway keeps for it.

Each replica has its own connection pool (`EngineClient`), its own record in the gateway's shared memory (readiness,
progress, the exchanges in flight in every worker: `SharedPoolState`), its own monitor (busy is not dead, a hung one
is caught) and its own admission (the engine's queue, by priority, across every gateway sharing Redis): what the one
engine had before, once per replica. Imports settings, metrics, Redis's client type, the relay and admission.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

import redis.asyncio as redis_asyncio
from prometheus_client import Counter

from gateway.metrics.instruments import GatewayMetrics
from gateway.ratelimit import EngineAdmission
from gateway.relay.activity import EngineActivity
from gateway.relay.client import EngineClient
from gateway.relay.monitor import EngineMonitor
from gateway.relay.readiness import SharedEngineState
from gateway.relay.served_model import ModelInfo, ModelOverrides
from gateway.request_record import EngineErrorKind
from gateway.settings import Settings


class Replica:
    """One engine the gateway routes to: its URL, client, monitor, admission and load."""

    __slots__ = ("_errors", "_metrics", "activity", "admission", "client", "local", "monitor", "url")

    def __init__(
        self,
        url: str,
        settings: Settings,
        metrics: GatewayMetrics,
        redis: redis_asyncio.Redis,
        shared: SharedEngineState,
        *,
        state_dir: Path | None,
        overrides: ModelOverrides | None = None,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        """The replica at `url`; `shared`: its record in the gateway's shared memory; `state_dir`: where its
        supervisor on this host writes its status (None: not supervised here); `overrides`: what the operator set
        of its model (the local engine's only); `on_change`: called when its readiness or model changes."""
        self.url = url
        self.local = state_dir is not None
        self.client = EngineClient(settings, url)
        self.activity = EngineActivity(shared)
        self.admission = EngineAdmission(redis, settings, metrics, url=url, state_dir=state_dir)
        self.monitor = EngineMonitor(
            self.client,
            settings.relay,
            metrics,
            self.activity,
            state_dir=state_dir,
            overrides=overrides,
            load_observer=self._observe_load,
            replica=url,
            on_change=on_change,
        )
        self.admission.model_name = lambda: self.model_name or ""
        if state_dir is None:  # no supervisor's status to read the policy from: the operator's word
            self.monitor.priority_scheduling = settings.routing.remote_scheduling == "priority"
        self._metrics = metrics
        self._errors: dict[str, dict[EngineErrorKind, Counter]] = {}

    def __repr__(self) -> str:
        return f"Replica({self.url!r}, model={self.model_name!r})"

    async def start(self) -> None:
        """Open its connection pool and take part in probing it."""
        await self.client.start()
        await self.monitor.start()

    async def stop(self) -> None:
        """Stop probing it and close its connections."""
        await self.monitor.stop()
        await self.client.stop()

    @property
    def errors(self) -> dict[EngineErrorKind, Counter]:
        """Its engine-failure counters by kind, labelled with the model it serves (each model's looked up once)."""
        return self._error_counters(self.model_name or "")

    def _error_counters(self, model: str) -> dict[EngineErrorKind, Counter]:
        counters = self._errors.get(model)
        if counters is None:  # the first time: every kind's series, at 0
            counters = self._errors[model] = {
                kind: self._metrics.engine_errors.labels(self.url, model, kind.value) for kind in EngineErrorKind
            }
        return counters

    @property
    def drained(self) -> bool:
        """Whether an operator drained it (every worker reads the flag the probing worker keeps)."""
        return self.activity.shared.drained

    @property
    def probing(self) -> bool:
        """Whether this worker holds its probe turn (and so keeps its shared flags)."""
        return self.monitor.probing

    @property
    def model(self) -> ModelInfo | None:
        """The model it serves, or served when last up (None: never seen up by this worker)."""
        return self.monitor.model or self.monitor.last_model

    @property
    def model_name(self) -> str | None:
        """The name of `model`."""
        model = self.model
        return None if model is None else model.name

    def ready_reason(self) -> str | None:
        """None when it takes new requests, else why not (drained, or its monitor's reason)."""
        reason = self.monitor.ready_reason()
        if reason is None and self.drained:
            return "drained"
        return reason

    @property
    def ready(self) -> bool:
        """Whether it takes new requests now."""
        return not self.drained and self.monitor.ready_reason() is None

    async def _observe_load(self, scrape: Callable[[], Awaitable[str]]) -> None:
        """The probing worker's scrape of the engine's load: for its admission, and kept for every worker's picker."""
        load = await self.admission.observe(scrape)
        if self.model_name:
            self._error_counters(self.model_name)  # its failure series exist (at 0) from the first scrape
        if load is not None:
            self.activity.shared.publish_engine_load(load.running + load.waiting, load.kv_cache_use)

    def load(self) -> float:
        """Its outstanding work: the exchanges every worker of this gateway has in flight with it now (exact, and
        current), or the requests the engine itself runs and queues where its last scrape says more (other
        gateways' too); plus its KV-cache use, from 0 to 1, so that of two replicas with as many requests the one
        with the emptier cache is the lighter."""
        queued, kv_cache_use = self.activity.shared.engine_load
        return max(float(self.activity.shared.outstanding()), queued) + kv_cache_use
