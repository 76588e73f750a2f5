"""EngineMonitor: the gateway's own cached view of the engine (ready or why not, served model, context length).

Requests are refused with a fast 503 while the engine is known to be down, instead of each one
waiting on a hung engine. Readiness must not flap under load, and must mean "it generates":

- down: a refused connection (also reported by the relay at once), or /health answering non-200;
- stuck ("engine not generating"): the engine generated since it came up (a cold engine's first
  generations may be slow), then a one-token generation probe failed, no progress was seen since it
  started, and either nothing was in flight or requests waited `stall_timeout` seconds without a
  chunk or answer. The requests in flight are then ended with an error;
- never down for a late /health alone: a saturated engine answers /health late while it streams.

Progress (chunks, answers) is what the relay records in `EngineActivity`; the generation probe runs
only when the engine has been quiet for `probe_interval`.

Each gateway worker has its own monitor. So that /ready answering 200 from one worker means the next
request is served by any of them, a monitor that last saw the engine down, and learns from
`engine_seen_ready()` that another worker has seen it ready since, probes again before it refuses
(`confirmed_reason`): one probe, shared by the callers that arrive meanwhile, waited on for at most
`CONFIRM_WAIT` (a refused connection or a /health answer take milliseconds; a port that accepts and
never answers must not hold requests). Without that word, a refusal costs the engine nothing.
Each periodic probe of a ready engine also reads the scheduling policy its supervisor launched it with
(`engine.json`: `priority` is sent only to a "priority" engine) and hands the engine's /metrics to the
load observer (admission), so no second poller runs.
Imports settings, errors, metrics, the background-task helper, the supervisor's status record (a leaf) and
the relay's client, activity, model and shared modules.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from gateway.background import BackgroundTask
from gateway.errors import EngineCredentialsError, EngineRefusedError, EngineUnavailableError, GatewayError
from gateway.metrics import GatewayMetrics
from gateway.relay.activity import EngineActivity
from gateway.relay.client import EngineClient
from gateway.relay.model import ModelInfo
from gateway.relay.shared import SharedInstant, engine_seen_ready
from gateway.settings import Settings
from gateway.supervisor.state import PRIORITY, STATUS_FILE, launched_policy

LoadObserver = Callable[[Callable[[], Awaitable[str]]], Awaitable[None]]

logger = logging.getLogger(__name__)

NOT_GENERATING = "engine not generating"
CONFIRM_WAIT = 0.5  # seconds a request waits for the confirming probe of an engine last seen down


class EngineMonitor:
    """Probes the engine on an interval, judges whether it generates, and remembers what it serves."""

    def __init__(
        self,
        client: EngineClient,
        settings: Settings,
        metrics: GatewayMetrics,
        activity: EngineActivity,
        seen_ready: SharedInstant | None = None,
        load_observer: LoadObserver | None = None,
    ) -> None:
        self._client = client
        self._settings = settings
        self._relay = settings.relay
        self._metrics = metrics
        self._activity = activity
        self._health_reason: str | None = "not probed yet"  # refused, non-200 /health, or the model unknown
        self._seen_down_at = 0.0  # when the probe or request that last found the engine down started
        # When any worker of this gateway last found it ready (a test passes its own).
        self._seen_ready = seen_ready or engine_seen_ready()
        self._stuck = False
        self._probe_failed_since: float | None = None  # start of the last failed generation probe
        self._generation_probe: asyncio.Task[None] | None = None
        self._probe_refused_logged = False
        # Progress seen before the engine last came up; "stuck" is judged only once it generated since
        # (a cold CPU engine's first generations may outlast the probe timeout).
        self._progress_mark = activity.last_progress
        self._published: str | None = "not probed yet"
        self._check_running: asyncio.Future[str | None] | None = None
        self.model: ModelInfo | None = None
        # Whether the engine schedules by priority (its launcher's word; False when unknown: vLLM under FCFS
        # may refuse a non-zero `priority`).
        self.priority_scheduling = False
        self._status_file = settings.engine.state_dir / STATUS_FILE
        self._load_observer = load_observer
        self._task = BackgroundTask.every("engine-monitor", self._relay.probe_interval, self._periodic)

    async def start(self) -> None:
        """Probe once now (so the first requests know), then keep probing in the background."""
        await self._periodic()
        self._task.start()

    async def _periodic(self) -> None:
        """The interval's work: probe; once ready, learn the scheduling policy and let admission read the load."""
        if await self.check() is not None:
            return
        # Each time, not only when the engine comes up: a restart quicker than a probe is never seen down.
        await self._learn_policy()
        if self._load_observer is not None:
            await self._load_observer(self._scrape)

    async def _learn_policy(self) -> None:
        policy = await asyncio.to_thread(launched_policy, self._status_file)
        if (policy == PRIORITY) != self.priority_scheduling:
            logger.info("engine scheduling policy: %s", policy)
            self.priority_scheduling = policy == PRIORITY

    async def _scrape(self) -> str:
        return await self._client.metrics_text(self._relay.probe_timeout)

    async def stop(self) -> None:
        """Stop probing."""
        await self._task.stop()
        for running in (self._generation_probe, self._check_running):
            if running is not None:
                running.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await running
        self._generation_probe = self._check_running = None

    def ready_reason(self) -> str | None:
        """None when the engine is ready, else a short reason ("connection refused"); cached, no I/O."""
        if self._health_reason is not None:
            return self._health_reason
        if self._stuck:
            return NOT_GENERATING
        if self.model is None:
            return "model unknown"
        return None

    async def confirmed_reason(self) -> str | None:
        """`ready_reason()`, asked again of the engine first when this process last saw it down and another
        worker has seen it ready since (not when stuck: liveness judges that)."""
        if self._health_reason is not None and self._seen_ready.value() > self._seen_down_at:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.check(), CONFIRM_WAIT)
        return self.ready_reason()

    async def require_ready(self) -> ModelInfo:
        """The served model, or EngineUnavailableError (503 + Retry-After) while the engine is not ready
        (confirmed: see `confirmed_reason`)."""
        reason = await self.confirmed_reason()
        if reason is not None or self.model is None:
            raise EngineUnavailableError(
                f"The model engine is not ready ({reason or 'model unknown'}); retry shortly.",
                retry_after=self._relay.retry_after,
            )
        return self.model

    def mark_down(self, reason: str) -> None:
        """A request found the engine unreachable (`reason`, short): refuse fast until /health answers 200."""
        self._health_reason = reason
        self._seen_down_at = time.monotonic()
        self._publish()

    async def check(self) -> str | None:
        """Probe /health now (learning the model once it is healthy), judge liveness; `ready_reason()`.

        Callers that arrive while a check runs share it (the periodic one and requests confirming)."""
        if self._check_running is None:
            self._check_running = asyncio.ensure_future(self._check())
        # shield: one caller's cancellation must not cancel the check the others wait for.
        return await asyncio.shield(self._check_running)

    async def _check(self) -> str | None:
        started = time.monotonic()
        try:
            self._health_reason = await self._probe_health()
            if self._health_reason is None and self.model is None:
                self._health_reason = await self._learn_model()
                await self._learn_policy()
            if self._health_reason is not None:
                self._seen_down_at = started
            self._judge_liveness()
            self._publish()
            return self.ready_reason()
        finally:
            self._check_running = None

    async def _probe_health(self) -> str | None:
        try:
            status = await self._client.health(self._relay.probe_timeout)
        except EngineRefusedError:
            return "connection refused"
        except GatewayError as exc:
            # Late or cut short: a busy engine does this too, so it decides nothing (liveness does).
            logger.debug("engine /health inconclusive: %s", exc.message)
            return self._health_reason
        return None if status == 200 else f"/health answered {status}"

    async def _learn_model(self) -> str | None:
        try:
            listing = await self._client.get_json("/v1/models", self._relay.probe_timeout)
            self.model = ModelInfo.from_listing(listing, self._settings)
        except EngineCredentialsError as exc:
            logger.error("%s", exc.message)
            return "engine key refused"
        except GatewayError as exc:
            logger.warning("engine model list unavailable: %s", exc.message)
            return "model list unavailable"
        logger.info("engine serves %r (context length %s)", self.model.name, self.model.context_length)
        return None

    def _judge_liveness(self, *, may_probe: bool = True) -> None:
        """Start a generation probe when the engine has been quiet (`may_probe`); decide whether it is stuck.

        Probes start only from the periodic check, so an engine that fails them fast is not hammered.
        """
        activity = self._activity
        if self._health_reason is not None or self.model is None:
            self._stuck = False
            self._probe_failed_since = None
            self._progress_mark = activity.last_progress
            return
        quiet = activity.quiet_for()
        if may_probe and self._generation_probe is None and quiet >= self._relay.probe_interval:
            self._generation_probe = asyncio.create_task(
                self._probe_generation(self.model.name), name="engine-generation-probe"
            )
        failed_since = self._probe_failed_since
        if failed_since is not None and activity.last_progress >= failed_since:
            failed_since = self._probe_failed_since = None  # it generated after all
        warmed_up = activity.last_progress > self._progress_mark
        stuck = (
            warmed_up and failed_since is not None and (activity.in_flight == 0 or quiet >= self._relay.stall_timeout)
        )
        if stuck and not self._stuck:
            ended = activity.abort_all()
            logger.warning(
                "engine is not generating: no progress for %.1f s and a generation probe failed; "
                "%d request(s) in flight ended",
                quiet,
                ended,
            )
        self._stuck = stuck

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
            self.mark_down("connection refused")
            return
        except GatewayError as exc:
            failure = exc.message
        finally:
            self._generation_probe = None
        if failure is not None and self._activity.last_progress < started:
            logger.info("engine generation probe failed: %s", failure)
            self._probe_failed_since = started
        self._judge_liveness(may_probe=False)
        self._publish()

    def _publish(self) -> None:
        reason = self.ready_reason()
        if reason != self._published:
            if reason is None:
                self._seen_ready.record_now()
                logger.info("engine is ready")
            else:
                logger.warning("engine is not ready: %s", reason)
            if self._health_reason is not None:
                # Down, not merely stuck: it may come back as another model or context length (a restart).
                self.model = None
            self._published = reason
        self._metrics.engine_up.set(0 if reason else 1)
