"""EngineMonitor: this worker's window on the gateway's one view of the engine (ready or why not, served model).

Requests are refused with a fast 503 while the engine is known to be down, instead of each one
waiting on a hung engine. Readiness must not flap under load, and must mean "it generates":

- down: a refused connection (also reported by the relay at once), or /health answering non-200;
- stuck ("engine not generating"): the engine generated since it came up (a cold engine's first
  generations may be slow), then a one-token generation probe failed, no progress was seen since it
  started, and either nothing was in flight or requests waited `stall_timeout` seconds without a
  chunk or answer. The requests in flight are then ended with an error. Only progress clears it: vLLM's
  /health stays 200 while its engine core hangs;
- never down for a late /health alone: a saturated engine answers /health late while it streams.

Readiness is one fact per gateway (see gateway/relay/readiness.py): the verdict lives in the gateway's
SharedEngineState, and the worker holding the probe turn is the only one that probes /health and sends the
idle generation probe; the others read the verdict (no I/O) and take the turn over when its holder stops
renewing it. So every worker answers /ready, and admits or refuses a request, the same way. A worker that
has not learned the model the prober found (a new epoch: the engine came up) learns it before it answers
(`confirmed_reason`), waiting at most `CONFIRM_WAIT`, so a /ready 200 from one worker means the next request
is served by any of them.

Progress (chunks, answers) is what the relay records in `EngineActivity`; the generation probe runs
only when the whole gateway has seen the engine quiet for `probe_interval`.

Each worker also reads, whenever it learns the model and on every tick, the scheduling policy the supervisor
launched the engine with (`engine.json`: `priority` is sent only to a "priority" engine); the worker holding
the probe turn hands the engine's /metrics to the load observer (admission) on each tick, so one scrape per
interval serves the whole gateway.
It reads only the relay settings; the supervisor's state directory and the operator's model overrides are handed
to it. Imports settings, errors, metrics, the background-task helper, the supervisor's status record (a leaf)
and the relay's client, activity, served-model and engine-state modules.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from gateway.background import BackgroundTask
from gateway.engine.supervisor_state import PRIORITY, STATUS_FILE, launched_policy
from gateway.errors import EngineCredentialsError, EngineRefusedError, EngineUnavailableError, GatewayError
from gateway.metrics.instruments import GatewayMetrics
from gateway.relay.activity import EngineActivity
from gateway.relay.client import EngineClient
from gateway.relay.readiness import (
    HEALTH_STATUS,
    HEALTHY,
    KEY_REFUSED,
    MODELS_UNAVAILABLE,
    REFUSED,
    SharedEngineState,
)
from gateway.relay.served_model import ModelInfo, ModelOverrides
from gateway.settings import RelaySettings

logger = logging.getLogger(__name__)

NOT_GENERATING = "engine not generating"
MODEL_UNKNOWN = "model unknown"
CONFIRM_WAIT = 0.5  # seconds a request waits for this worker to learn the model the prober found
_FIRST_VERDICT_POLL = 0.05  # seconds between two looks at the shared record while a starting worker waits

LoadObserver = Callable[[Callable[[], Awaitable[str]]], Awaitable[object]]


class EngineMonitor:
    """Takes its turn probing the engine, judges whether it generates, and remembers what it serves."""

    def __init__(
        self,
        client: EngineClient,
        relay: RelaySettings,
        metrics: GatewayMetrics,
        activity: EngineActivity,
        *,
        state_dir: Path | None,
        overrides: ModelOverrides | None = None,
        load_observer: LoadObserver | None = None,
        replica: str = "",
        on_change: Callable[[], None] | None = None,
    ) -> None:
        """`state_dir`: where the engine supervisor writes its status file (the engine's scheduling policy; None for
        an engine this host does not supervise: FCFS assumed); `overrides`: what the operator set of the served
        model; `replica`: the engine's name in the metrics (its URL); `on_change`: called in this worker when the
        verdict or the model it serves changes (the pool's gauges follow at once, not at its next tick)."""
        self._client = client
        self._overrides = overrides or ModelOverrides()
        self._relay = relay
        self._metrics = metrics
        self._activity = activity
        self._shared: SharedEngineState = activity.shared
        # Who holds the probe turn: this monitor, not this process (two monitors may share a process in tests).
        self._token = int.from_bytes(os.urandom(7), "big") | 1
        # Renewed on every tick; long enough that a holder's own slow check does not lose it.
        self._lease = 2 * self._relay.probe_interval + self._relay.probe_timeout
        self._probe_failed_since: float | None = None  # start of the last failed generation probe (the prober's)
        self._generation_probe: asyncio.Task[None] | None = None
        self._probe_refused_logged = False
        self._published: str | None = "not probed yet"  # the last verdict this worker logged
        self._ended_for = 0.0  # the `stuck_since` whose exchanges this worker has ended
        self._check_running: asyncio.Future[str | None] | None = None
        self._catching_up: asyncio.Future[None] | None = None
        self.model: ModelInfo | None = None
        # The model it served when last up (kept while it is down): what a request for that model waits for.
        self.last_model: ModelInfo | None = None
        self._model_epoch = -1  # the engine's epoch `model` was learned in
        # Whether the engine schedules by priority (its launcher's word; False when unknown: vLLM under FCFS
        # may refuse a non-zero `priority`).
        self.priority_scheduling = False
        self._status_file = None if state_dir is None else state_dir / STATUS_FILE
        self._replica = replica
        self._named = ""  # the model name the replica's gauge was last set under (kept while it is down)
        self._policy_version: tuple[int, int] | None = (-1, -1)  # the status file's (inode, mtime) last read
        self._load_observer = load_observer
        self._on_change = on_change
        self._followed: tuple[str | None, str | None] = ("not probed yet", None)  # (readiness, model) last told
        self._task = BackgroundTask.every("engine-monitor", self._relay.probe_interval, self._tick)

    async def start(self) -> None:
        """Take the probe turn and probe once now when no other worker holds it, or wait (a bounded time) for the
        first verdict of the one that does and learn what it found; then keep doing so in the background. So the
        first requests a worker serves know the engine's state, as they would had it probed itself."""
        await self.check()
        deadline = time.monotonic() + 2 * self._relay.probe_timeout + CONFIRM_WAIT
        while not self._shared.verdict().probed and time.monotonic() < deadline:
            await asyncio.sleep(_FIRST_VERDICT_POLL)
            await self.check()  # takes the turn over should its holder have stopped
        await self.confirmed_reason()
        await self._tick()
        self._task.start()

    async def _tick(self) -> None:
        """The interval's work: check; once ready, the policy again (a restart quicker than a probe is never seen
        down) and, for the probe turn's holder, the engine's load."""
        if await self.check() is not None:
            return
        await self._learn_policy()
        if self._load_observer is not None and self._shared.holds_probe_turn(self._token):
            await self._load_observer(self._scrape)

    async def _scrape(self) -> str:
        text, _ = await self._client.metrics(self._relay.probe_timeout)
        return text.decode("utf-8", "replace")

    async def _learn_policy(self) -> None:
        # Read (in a thread) only when the supervisor has rewritten the file (it replaces it: a new inode): every
        # worker looks on every tick, and a thread's round trip each time was a good part of an idle worker's CPU.
        # A stat of the local state file takes microseconds, so it runs on the loop.
        if self._status_file is None:
            return
        try:
            found = os.stat(self._status_file)
            version: tuple[int, int] | None = (found.st_ino, found.st_mtime_ns)
        except OSError:
            version = None
        if version == self._policy_version:
            return
        self._policy_version = version
        policy = await asyncio.to_thread(launched_policy, self._status_file)
        if (policy == PRIORITY) != self.priority_scheduling:
            logger.info("engine scheduling policy: %s", policy)
            self.priority_scheduling = policy == PRIORITY

    async def stop(self) -> None:
        """Stop probing."""
        await self._task.stop()
        for running in (self._generation_probe, self._check_running, self._catching_up):
            if running is not None:
                running.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await running
        self._generation_probe = self._check_running = self._catching_up = None

    @property
    def probing(self) -> bool:
        """Whether this worker holds the engine's probe turn now."""
        return self._shared.holds_probe_turn(self._token)

    def ready_reason(self) -> str | None:
        """None when the engine is ready, else a short reason ("connection refused"); the shared verdict, no I/O."""
        verdict = self._shared.verdict()
        if verdict.reason is not None:
            return verdict.reason
        if self.model is None or self._model_epoch != verdict.epoch:
            return MODEL_UNKNOWN
        return None

    async def confirmed_reason(self) -> str | None:
        """`ready_reason()`, after learning the served model first when the prober has found the engine ready and
        this worker does not know what it serves yet (shared by the callers meanwhile, at most CONFIRM_WAIT)."""
        if self.ready_reason() == MODEL_UNKNOWN:
            if self._catching_up is None:
                self._catching_up = asyncio.ensure_future(self._catch_up())
            with contextlib.suppress(TimeoutError):
                # shield: one caller's timeout must not cancel what the others wait for.
                await asyncio.wait_for(asyncio.shield(self._catching_up), CONFIRM_WAIT)
        return self.ready_reason()

    async def require_ready(self) -> ModelInfo:
        """The served model, or EngineUnavailableError (503 + Retry-After) while the engine is not ready."""
        reason = await self.confirmed_reason()
        if reason is not None or self.model is None:
            raise EngineUnavailableError(
                f"The model engine is not ready ({reason or MODEL_UNKNOWN}); retry shortly.",
                retry_after=self._relay.retry_after,
            )
        return self.model

    def mark_refused(self) -> None:
        """A request found the engine refusing connections: every worker refuses fast until /health answers 200."""
        self._shared.publish_down(REFUSED, time.monotonic())
        self._follow()

    async def check(self) -> str | None:
        """Probe /health now when this worker holds (or can take) the probe turn, and judge liveness; else follow
        the verdict of the worker that does. `ready_reason()`.

        Callers that arrive while a check runs share it."""
        if not self._shared.take_probe_turn(self._token, self._lease):
            self._follow()
            return self.ready_reason()
        if self._check_running is None:
            self._check_running = asyncio.ensure_future(self._check())
        # shield: one caller's cancellation must not cancel the check the others wait for.
        return await asyncio.shield(self._check_running)

    async def _check(self) -> str | None:
        started = time.monotonic()
        try:
            health = await self._probe_health()
            shared = self._shared
            verdict = shared.verdict()
            down = verdict.down
            fresh = started >= shared.verdict_at  # no newer evidence (a refused request) was published meanwhile
            if health is not None and health[0] != HEALTHY:
                if fresh:
                    shared.publish_down(health[0], started, detail=health[1])
            elif health is not None and (down is not None or self.model is None or self._model_epoch != verdict.epoch):
                learned = await self._learn_model()
                if learned != HEALTHY:
                    shared.publish_down(learned, started)
                elif down is None:
                    self._model_epoch = shared.verdict().epoch  # up all along: this worker took the turn over
                elif fresh:
                    shared.publish_up(started)  # it came up: a new epoch, not stuck
                    self._model_epoch = shared.verdict().epoch
            self._judge_liveness()
            self._follow()
            return self.ready_reason()
        finally:
            self._check_running = None

    async def _probe_health(self) -> tuple[int, int] | None:
        """(code, detail) for the shared verdict, or None when inconclusive."""
        try:
            status = await self._client.health(self._relay.probe_timeout)
        except EngineRefusedError:
            return REFUSED, 0
        except GatewayError as exc:
            # Late or cut short: a busy engine does this too, so it decides nothing (liveness does).
            logger.debug("engine /health inconclusive: %s", exc.message)
            return None
        return (HEALTHY, 0) if status == 200 else (HEALTH_STATUS, status)

    async def _learn_model(self) -> int:
        try:
            listing = await self._client.get_json("/v1/models", self._relay.probe_timeout)
            self.model = self.last_model = ModelInfo.from_listing(listing, self._overrides)
        except EngineCredentialsError as exc:
            logger.error("%s", exc.message)
            return KEY_REFUSED
        except GatewayError as exc:
            logger.warning("engine model list unavailable: %s", exc.message)
            return MODELS_UNAVAILABLE
        logger.info("engine serves %r (context length %s)", self.model.name, self.model.context_length)
        await self._learn_policy()
        return HEALTHY

    async def _catch_up(self) -> None:
        try:
            epoch = self._shared.verdict().epoch
            if await self._learn_model() == HEALTHY:
                self._model_epoch = epoch
        finally:
            self._catching_up = None
        self._tell_change()

    def _judge_liveness(self, *, may_probe: bool = True) -> None:
        """The prober's: start a generation probe when the gateway has seen the engine quiet (`may_probe`);
        decide whether it is stuck.

        Probes start only from the periodic check, so an engine that fails them fast is not hammered.
        """
        shared = self._shared
        verdict = shared.verdict()
        if verdict.down is not None or self.model is None:
            self._probe_failed_since = None
            return
        last_progress = shared.last_progress
        quiet = time.monotonic() - last_progress
        if may_probe and self._generation_probe is None and quiet >= self._relay.probe_interval:
            self._generation_probe = asyncio.create_task(
                self._probe_generation(self.model.name), name="engine-generation-probe"
            )
        failed_since = self._probe_failed_since
        if failed_since is not None and last_progress >= failed_since:
            failed_since = self._probe_failed_since = None  # it generated after all
        if verdict.stuck or failed_since is None or last_progress <= shared.progress_mark:
            return  # stuck already, no failed probe, or not warmed up since it came up
        if shared.in_flight() == 0 or quiet >= self._relay.stall_timeout:
            shared.mark_stuck(failed_since)
            logger.warning("engine is not generating: no progress for %.1f s and a generation probe failed", quiet)

    async def _probe_generation(self, model: str) -> None:
        started = time.monotonic()
        failure: str | None = None
        try:
            status = await self._client.generate(model, self._relay.generation_probe_timeout)
            if status == 200:
                self._activity.progress()
            elif status >= 500:
                failure = f"answered {status}"
            elif not self._probe_refused_logged:  # the API server answered; no word on generation either way
                self._probe_refused_logged = True
                logger.warning("engine generation probe answered %d; liveness rests on traffic alone", status)
        except EngineRefusedError:
            self._generation_probe = None
            self.mark_refused()
            return
        except GatewayError as exc:
            failure = exc.message
        finally:
            self._generation_probe = None
        if failure is not None and self._shared.last_progress < started:
            logger.info("engine generation probe failed: %s", failure)
            self._probe_failed_since = started
        self._judge_liveness(may_probe=False)
        self._follow()

    def _follow(self) -> None:
        """Act on the shared verdict in this worker: end its exchanges once the engine is found stuck, forget the
        model while it is down (it may come back as another) and learn it once it is up, log a change (the prober
        only: one line per gateway), set the gauge (the gateway's verdict, as in every worker)."""
        shared = self._shared
        verdict = shared.verdict()
        if verdict.stuck and shared.stuck_since != self._ended_for:
            self._ended_for = shared.stuck_since
            ended = self._activity.abort_all()
            if ended:
                logger.warning("engine not generating: %d request(s) in flight ended", ended)
        if verdict.down is not None:
            self.model = None
        elif self._model_epoch != verdict.epoch and self._catching_up is None and not verdict.stuck:
            # The prober found it ready: learn the model now rather than on the first request that reaches us.
            self._catching_up = asyncio.ensure_future(self._catch_up())
        reason = verdict.reason
        if reason != self._published:
            level = logging.INFO if reason is None else logging.WARNING
            if not self._shared.holds_probe_turn(self._token):
                level = logging.DEBUG
            if reason is None:
                logger.log(level, "engine is ready")
            else:
                logger.log(level, "engine is not ready: %s", reason)
            self._published = reason
        if self.model is not None and self.model.name != self._named:
            if self._named:  # it serves another model now: its old series says so (a multiprocess series stays)
                self._metrics.replica_up.labels(self._replica, self._named).set(0)
            self._named = self.model.name
        self._metrics.replica_up.labels(self._replica, self._named).set(0 if reason else 1)
        self._tell_change()

    def _tell_change(self) -> None:
        """Call `on_change` when this worker's readiness or the model it knows changed since it last did."""
        followed = (self.ready_reason(), None if self.model is None else self.model.name)
        if followed != self._followed:
            self._followed = followed
            if self._on_change is not None:
                self._on_change()
