"""ReplicaPool: every engine replica this gateway routes to, by the model each serves.

Where the replicas come from, in this order: this host's engines (`engine_url`, or the supervisor's managed replicas,
`Settings.local_replica_urls`), the `replicas` setting, and the watched `replicas_file` (one URL a line; a replica
added there joins within `routing.file_poll_interval` seconds, one removed leaves: no new request goes to it, and
the requests it has run to their end on its own connections). A replica's model is what its /v1/models names.

Each worker keeps its own pool, alike in every worker: the replicas' records (readiness, progress, exchanges in flight)
are the gateway's shared memory, found by URL, and drains are read from Redis on every tick. A request goes to a
ready, undrained replica of the model it names, picked by the model's picker (`pool/pickers.py`); `/ready` is 200
while every served model has one.
Imports settings, metrics, background tasks, the relay's shared state and served model, and the pool's modules.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import redis.asyncio as redis_asyncio
from redis.exceptions import RedisError

from gateway.background import BackgroundTask
from gateway.errors import EngineUnavailableError
from gateway.metrics.instruments import GatewayMetrics
from gateway.pool.drain import drained_replicas
from gateway.pool.pickers import Picker
from gateway.pool.replica import Replica
from gateway.relay.readiness import SharedPoolState
from gateway.relay.served_model import ModelInfo, ModelOverrides, ServedModels
from gateway.settings import Settings

logger = logging.getLogger(__name__)

# The drains are read from Redis every this many ticks (6 s by default): an idle gateway's prober wakes for each
# read, and a drain is an operator's step that `replicas restart` waits to see in /ready before going on.
_DRAIN_TICKS = 3


def read_replicas_file(path: Path) -> tuple[str, ...]:
    """The replica URLs in `path`: one a line, blank lines and `#` comments skipped, a trailing slash dropped; a line
    that is not an http(s) URL is logged and skipped (a typo must not take the other replicas out)."""
    urls: list[str] = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        if not text.startswith(("http://", "https://")) or " " in text:
            logger.warning("%s line %d is not a replica URL (http://host:port): skipped", path, number)
            continue
        urls.append(text.rstrip("/"))
    return tuple(dict.fromkeys(urls))


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """One replica as /ready and the operator's `replicas list` show it: `ready`, its engine generates (drained or
    not); `drained`, an operator took it out of the pool; `reason`, why it takes no new request (None: it does)."""

    url: str
    model: str | None
    ready: bool
    drained: bool
    reason: str | None
    in_flight: int
    local: bool

    def to_json(self) -> dict[str, object]:
        """The JSON object /ready lists."""
        return {
            "url": self.url,
            "model": self.model,
            "ready": self.ready,
            "drained": self.drained,
            "reason": self.reason,
            "in_flight": self.in_flight,
            "local": self.local,
        }


class ReplicaPool:
    """The replicas, their models and pickers; what a request is routed by."""

    def __init__(
        self, settings: Settings, metrics: GatewayMetrics, redis: redis_asyncio.Redis, shared: SharedPoolState
    ) -> None:
        self._settings = settings
        self._metrics = metrics
        self._redis = redis
        self._shared = shared
        self._local = settings.local_replica_urls()
        self._configured = tuple(dict.fromkeys((*self._local, *settings.replicas)))
        self._file = settings.replicas_file
        self._file_version: tuple[int, int, int] | None = None
        self._from_file: tuple[str, ...] = ()
        self._replicas: dict[str, Replica] = {}
        self._leaving: set[asyncio.Task[None]] = set()
        self._pickers: dict[str, Picker] = {}
        self._exported: set[str] = set()  # models whose ready-replica gauge this worker set
        self._ticks = 0
        # Without a file to watch, a tick only reads the drains and refreshes the gauges: every third interval, so
        # that an idle worker wakes no more than it must.
        self._drain_ticks = _DRAIN_TICKS if self._file is not None else 1
        interval = settings.routing.file_poll_interval * (1 if self._file is not None else _DRAIN_TICKS)
        self._task = BackgroundTask.every("replica-pool", interval, self._tick)

    # Life cycle.

    async def start(self) -> None:
        """Start every configured replica's monitor (together: a replica that does not answer delays the start by
        its probe timeout, not the others'), read drains, then keep watching the file and the drains."""
        await self._join(self._wanted())
        await self._refresh_drains(every=True)
        self._export()
        self._task.start()

    async def stop(self) -> None:
        """Stop watching, then every replica."""
        await self._task.stop()
        replicas, self._replicas = list(self._replicas.values()), {}
        await asyncio.gather(*(replica.stop() for replica in replicas), return_exceptions=True)
        for leaving in list(self._leaving):
            leaving.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await leaving

    async def _tick(self) -> None:
        self._ticks += 1
        if self._ticks % self._drain_ticks == 0:
            await self._refresh_drains()
        wanted = self._wanted()
        if wanted.keys() != self._replicas.keys():
            await self._join({url: d for url, d in wanted.items() if url not in self._replicas})
            for url in [url for url in self._replicas if url not in wanted]:
                self._leave(url)
        self._export()

    def _wanted(self) -> dict[str, Path | None]:
        """Every replica wanted now, each with its supervisor's state directory on this host (None: elsewhere)."""
        wanted: dict[str, Path | None] = {}
        engine = self._settings.engine
        for index, url in enumerate(self._local):
            wanted[url] = engine.replica_state_dir(index)
        for url in (*self._configured, *self._read_file()):
            wanted.setdefault(url, None)
        return wanted

    def _read_file(self) -> tuple[str, ...]:
        """The watched file's replicas, read again only when it changed (a stat per tick); a file that is gone or
        unreadable leaves its replicas out (logged once per change)."""
        if self._file is None:
            return ()
        try:
            found = os.stat(self._file)
            version: tuple[int, int, int] | None = (found.st_ino, found.st_mtime_ns, found.st_size)
        except OSError:
            version = None
        if version == self._file_version:
            return self._from_file
        self._file_version = version
        try:
            self._from_file = () if version is None else read_replicas_file(self._file)
        except (OSError, UnicodeDecodeError) as exc:
            logger.warning("replicas file %s unreadable: %s", self._file, exc)
            self._from_file = ()
        if version is None:
            logger.warning("replicas file %s not found: no replica from it", self._file)
        logger.info("replicas file %s: %d replica(s)", self._file, len(self._from_file))
        return self._from_file

    async def _join(self, joining: dict[str, Path | None]) -> None:
        first_local = self._local[0] if self._local else None
        overrides = ModelOverrides(self._settings.model_name, self._settings.context_length)
        added = [
            Replica(
                url,
                self._settings,
                self._metrics,
                self._redis,
                self._shared.record(url),
                state_dir=state_dir,
                overrides=overrides if url == first_local else None,
                on_change=self._export,
            )
            for url, state_dir in joining.items()
        ]
        for replica in added:
            self._replicas[replica.url] = replica
        results = await asyncio.gather(*(replica.start() for replica in added), return_exceptions=True)
        for replica, result in zip(added, results, strict=True):
            if isinstance(result, BaseException):
                logger.error("replica %s did not start: %s", replica.url, result)
                self._replicas.pop(replica.url, None)
                await replica.stop()
            elif self._task.running:
                logger.info("replica %s joined the pool", replica.url)

    def _leave(self, url: str) -> None:
        """`url` leaves: no new request goes to it; its connections close once the exchanges on them are over."""
        replica = self._replicas.pop(url)
        logger.info("replica %s left the pool", url)
        task = asyncio.create_task(self._retire(replica), name=f"replica-leaves-{url}")
        self._leaving.add(task)
        task.add_done_callback(self._leaving.discard)

    async def _retire(self, replica: Replica) -> None:
        await replica.monitor.stop()
        grace = self._settings.shutdown_grace
        waited = 0.0
        while replica.activity.in_flight and waited < grace:
            await asyncio.sleep(0.5)
            waited += 0.5
        await replica.client.stop()

    async def _refresh_drains(self, *, every: bool = False) -> None:
        """Read the drains from Redis into the shared flags of the replicas this worker probes (`every`: of all,
        at the start), so that one worker per replica asks Redis, not every worker on every tick."""
        mine = [replica for replica in self._replicas.values() if every or replica.probing]
        if not mine:
            return
        try:
            drained = frozenset(await drained_replicas(self._redis))
        except (RedisError, OSError) as exc:
            logger.debug("replica drains not read: %s", exc)  # the last known drains stand
            return
        for replica in mine:
            if replica.drained != (replica.url in drained):
                logger.info("replica %s %s", replica.url, "drained" if replica.url in drained else "back in the pool")
                replica.activity.shared.drained = replica.url in drained

    def _export(self) -> None:
        """The gauges: each replica's drain, each model's ready replicas, and whether every model has one."""
        ready: dict[str, int] = {}
        for replica in self._replicas.values():
            name = replica.model_name
            if name is None:
                continue
            ready[name] = ready.get(name, 0) + (1 if replica.ready else 0)
            self._metrics.replica_drained.labels(replica.url, name).set(1 if replica.drained else 0)
        for name in self._exported - ready.keys():
            self._metrics.model_ready_replicas.labels(name).set(0)
        for name, count in ready.items():
            self._metrics.model_ready_replicas.labels(name).set(count)
        self._exported |= ready.keys()
        self._metrics.engine_up.set(1 if ready and all(ready.values()) else 0)

    # What requests and /ready read.

    @property
    def replicas(self) -> list[Replica]:
        """Every replica in the pool now, in configuration order."""
        return list(self._replicas.values())

    async def confirm(self) -> None:
        """Learn what each replica the shared record calls ready serves, where this worker has not yet (at most
        the monitor's CONFIRM_WAIT, every replica at once)."""
        await asyncio.gather(*(replica.monitor.confirmed_reason() for replica in self._replicas.values()))

    async def served(self) -> ServedModels:
        """The models a request may name: each replica's (as last seen up), aliases naming the first replica's;
        503 while no replica at all is ready (as for the one engine before)."""
        await self.confirm()
        replicas = self._replicas.values()
        if not any(replica.ready_reason() is None for replica in replicas):
            reasons = "; ".join(f"{r.url}: {r.ready_reason()}" for r in replicas) or "no replica configured"
            raise EngineUnavailableError(
                f"The model engine is not ready ({reasons}); retry shortly.",
                retry_after=self._settings.relay.retry_after,
            )
        models: dict[str, ModelInfo] = {}
        for replica in replicas:
            model = replica.model
            if model is not None:
                models.setdefault(model.name, model)
        pending = any(replica.model is None for replica in replicas)
        return ServedModels(tuple(models.values()), self._settings.model_aliases, pending=pending)

    def ready_models(self) -> dict[str, list[Replica]]:
        """Each model with a ready replica, and those replicas."""
        models: dict[str, list[Replica]] = {}
        for replica in self._replicas.values():
            if replica.ready and replica.model_name is not None:
                models.setdefault(replica.model_name, []).append(replica)
        return models

    def pick(self, model: str, affinity: bytes | None, exclude: Iterable[Replica] = ()) -> tuple[Replica, str]:
        """A ready, undrained replica of `model` (not one of `exclude`) by the model's picker, and how it was picked;
        EngineUnavailableError (503) when there is none."""
        excluded = set(exclude)
        candidates = [
            replica
            for replica in self._replicas.values()
            if replica.ready and replica not in excluded and replica.model_name == model
        ]
        if not candidates:
            raise EngineUnavailableError(
                f"No replica serving {model!r} is ready now; retry shortly.",
                retry_after=self._settings.relay.retry_after,
            )
        picker = self._pickers.get(model)
        if picker is None:
            routing = self._settings.routing
            picker = self._pickers[model] = Picker(routing.pickers.get(model, routing.picker), routing)
        return picker.pick(candidates, affinity)

    def retarget(self, model: str) -> Callable[[Replica], Replica | None] | None:
        """Where a request of `model` goes when its replica refuses it before the first byte: the least loaded other
        ready replica of the model, or None when there is none (the function itself is None: failover is off)."""
        if not self._settings.routing.failover:
            return None

        def other(failed: Replica) -> Replica | None:
            try:
                return self.pick(model, None, exclude=(failed,))[0]
            except EngineUnavailableError:
                return None

        return other

    def views(self) -> list[ReplicaView]:
        """Every replica as /ready shows it."""
        return [
            ReplicaView(
                url=replica.url,
                model=replica.model_name,
                ready=replica.monitor.ready_reason() is None,
                drained=replica.drained,
                reason=replica.ready_reason(),
                in_flight=replica.activity.shared.in_flight(picked=True),
                local=replica.local,
            )
            for replica in self._replicas.values()
        ]

    def not_ready_reason(self) -> str | None:
        """None while every model a replica serves has a ready replica (and there is one), else why not."""
        models: dict[str | None, bool] = {}
        for replica in self._replicas.values():
            name = replica.model_name
            models[name] = models.get(name, False) or replica.ready
        served = {name: ok for name, ok in models.items() if name is not None}
        if not any(served.values()):
            first = next(iter(self._replicas.values()), None)
            reason = None if first is None else first.monitor.ready_reason()
            return reason or ("no replica configured" if first is None else "no replica is ready")
        missing = sorted(name for name, ok in served.items() if not ok)
        return None if not missing else "no ready replica of " + ", ".join(repr(name) for name in missing)
