"""EngineRelay: one request's exchange with the engine, from the first byte sent to the lease settled.

The route hands over a validated body and the request's rate-limit lease (`ratelimit.RequestLease`); the relay opens
the engine request (under a unique engine-side request id), reads the answer or hands the stream to
`SSERelay`, records progress for the monitor, marks the engine down on a refused connection, counts
every engine failure by kind (`nemotron_gateway_engine_errors_total`) and settles the exchange exactly
once, on every path (`Settlement`: the lease released with the tokens the engine reported, then the route's own
step). Answers are ASGI apps (`BufferedAnswer`, `SSERelay`), so no web framework is imported. Imports settings,
errors, metrics, the request record and the relay's own modules.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import orjson
from prometheus_client import Counter

from gateway.errors import (
    EngineBusyError,
    EngineConnectionLostError,
    EngineCredentialsError,
    EngineProtocolError,
    EngineRefusedError,
    EngineTimeoutError,
    EngineUnavailableError,
    GatewayError,
)
from gateway.metrics.instruments import GatewayMetrics
from gateway.relay.activity import EngineActivity, Picked
from gateway.relay.client import (
    ENGINE_KEY_MESSAGE,
    ENGINE_KEY_REFUSED,
    EngineClient,
    UpstreamResponse,
)
from gateway.relay.disconnect import ClientDisconnectedError, DisconnectWatch, run_until_disconnect
from gateway.relay.monitor import EngineMonitor
from gateway.relay.shapes import CHAT, WireShape
from gateway.relay.sse import SSERelay
from gateway.request_record import EngineErrorKind, RequestRecord
from gateway.settings import RelaySettings
from gateway.types import ASGIApp, Receive, Scope, Send

logger = logging.getLogger(__name__)

T = TypeVar("T")

# vLLM answers 503 for a request its own queue bounds refuse (vllm/exceptions.py, QueueOverflowError, 0.32).
ENGINE_BUSY = 503
# vLLM's answer (HTTP 500, vllm/v1/engine/exceptions.py, 0.26 and 0.32) while its API server outlives a dead
# EngineCore, until the supervisor restarts the engine: for the client that is the engine being down (503).
ENGINE_DEAD = b"EngineCore encountered an issue"
ENGINE_DEAD_MESSAGE = "The model engine stopped and is being restarted; retry after the Retry-After seconds."

# A route's own step once the exchange is settled (the stored response's owner remembered).
AfterSettle = Callable[[], Awaitable[None]]
CLIENT_CLOSED_REQUEST = 499

_KIND_OF_ERROR: tuple[tuple[type[GatewayError], EngineErrorKind], ...] = (
    (EngineRefusedError, EngineErrorKind.REFUSED),
    (EngineConnectionLostError, EngineErrorKind.CONNECTION_LOST),
    (EngineTimeoutError, EngineErrorKind.TIMEOUT),
    (EngineProtocolError, EngineErrorKind.PROTOCOL),
)


def error_kind(error: GatewayError) -> EngineErrorKind | None:
    """The kind of an engine failure raised by the client; None for errors that are not the engine's."""
    for error_type, kind in _KIND_OF_ERROR:
        if isinstance(error, error_type):
            return kind
    return None


class BufferedAnswer:
    """A complete answer (the engine's JSON, or an empty 499) as a minimal ASGI response."""

    __slots__ = ("body", "headers", "status")

    def __init__(self, status: int, body: bytes, content_type: str | None, headers: Mapping[str, str]) -> None:
        self.status = status
        self.body = body
        raw = [(b"content-length", str(len(body)).encode())]
        if content_type is not None:
            raw.append((b"content-type", content_type.encode("latin-1")))
        raw += [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in headers.items()]
        self.headers = raw

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status, "headers": self.headers})
        await send({"type": "http.response.body", "body": self.body, "more_body": False})


class HeldLease(Protocol):
    """The request's rate-limit lease as the exchange sees it (`ratelimit.RequestLease`): its headers go on the answer,
    and it is released when the exchange ends."""

    @property
    def headers(self) -> Mapping[str, str]:
        """The key's rate-limit headers (none until admitted)."""
        ...

    async def release(
        self, used_tokens: int | None, record: RequestRecord | None = None, *, served: bool = True
    ) -> None:
        """Reconcile with `used_tokens` (None keeps the estimate, 0 refunds), with the detail on `record`; not
        `served`: the request never reached the engine and costs the key nothing."""
        ...


class Settlement:
    """Settles one exchange, exactly once however often it is asked: counts its engine failure, if any, releases the
    key's lease with the tokens the engine reported, then runs the route's own step.

    Unknown usage keeps the estimate when the engine may have worked (a timeout after it took the request, a
    stream cut short, a client gone) and is refunded when it surely did not (a refused connection, an error
    answer, a failure before the request was sent).
    """

    __slots__ = ("_after", "_lease", "_record", "_settled", "errors")

    def __init__(
        self,
        record: RequestRecord,
        lease: HeldLease | None,
        after: AfterSettle | None,
        errors: Mapping[EngineErrorKind, Counter],
    ) -> None:
        self._record = record
        self._lease = lease
        self._after = after
        self.errors = errors  # the counters of the replica that answered (another after a failover)
        self._settled = False

    async def settle(self) -> None:
        """Count, release and run the route's step (the first call; later ones do nothing)."""
        if self._settled:
            return
        self._settled = True
        record = self._record
        record.engine_ended_at = time.perf_counter()
        kind = record.engine_error
        if kind is not None:
            self.errors[kind].inc()
        if self._lease is not None:
            used = record.total_tokens
            sent = record.engine_request_id is not None
            if used is None and (not sent or (kind is not None and not kind.engine_worked)):
                used = 0
            # Not sent, or refused at the engine's door (nothing listened): the engine never saw it.
            await self._lease.release(used, record, served=sent and kind is not EngineErrorKind.REFUSED)
        if self._after is not None:
            await self._after()


class _Waiter:
    """An exchange waiting for the engine's answer; the monitor ends it (by cancelling) when the engine is stuck."""

    __slots__ = ("_task", "frozen")

    def __init__(self) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self.frozen = False

    def abort_frozen(self) -> None:
        self.frozen = True
        self._task.cancel()


async def _beside(admitting: asyncio.Task[None], exchange: Coroutine[Any, Any, T]) -> T:
    """Run `exchange` while the key's admission runs in `admitting`: a refusal that comes first cancels the exchange
    (its engine connection is closed, so the engine aborts the request) and is raised in its place."""
    task = asyncio.current_task()
    assert task is not None
    refused = False

    def on_admission(done: asyncio.Task[None]) -> None:
        nonlocal refused
        if not done.cancelled() and done.exception() is not None:
            refused = True
            task.cancel()

    admitting.add_done_callback(on_admission)
    try:
        return await exchange
    except asyncio.CancelledError:
        # Ours (the refusal) unless the task was cancelled for another reason too (a client gone, a stuck engine).
        refusal = admitting.exception() if refused else None
        if refusal is not None and task.uncancel() == 0:
            raise refusal from None
        raise
    finally:
        admitting.remove_done_callback(on_admission)


async def _admitted(admitting: asyncio.Task[None], upstream: UpstreamResponse) -> None:
    """Wait for the admission of an exchange that ended first; a refusal closes the engine's answer."""
    try:
        await admitting
    except BaseException:
        upstream.close()
        raise


class Target(Protocol):
    """The replica an exchange goes to (`pool.Replica`): its client, monitor, activity and error counters."""

    @property
    def url(self) -> str:
        """Its base URL (its name in logs and metrics)."""
        ...

    @property
    def client(self) -> EngineClient:
        """Its connection pool."""
        ...

    @property
    def monitor(self) -> EngineMonitor:
        """Its readiness."""
        ...

    @property
    def activity(self) -> EngineActivity:
        """Its progress and exchanges in flight."""
        ...

    @property
    def errors(self) -> Mapping[EngineErrorKind, Counter]:
        """Its engine-failure counters, by kind."""
        ...


# Another replica of the exchange's model for a failover (None: there is none), given the one that refused.
Retarget = Callable[[Any], Any]


@dataclass(frozen=True, slots=True)
class Exchange:
    """One request's exchange as the route hands it over: what goes to the engine (`path`, `body`, `method`,
    `engine_headers`) and how its answer is read (`stream`; `shape`, the API's wire shape: how its stream ends and
    fails; `strip_usage`, drop the usage-only chunk the client did not ask for); the client's side (`record`,
    `receive`; `watch`, the request's connection where the server offers one, tells of a client gone without a
    second task, else `receive` is read for it); and what it holds for the key (`lease`; `admitting`, the key's
    admission where it runs beside the exchange, `RequestLease.acquire_beside`; `after`, the route's own step once
    settled; `response_fields`, what the gateway sets on every Responses object the engine answers: the stored
    state's `store` and `previous_response_id`, which the engine, called without its store, cannot know); where it
    goes (`target`, the replica picked; `picked`, the pick counted on it until the exchange opens; `retarget`,
    another replica of its model for one failover)."""

    path: str
    body: bytes
    record: RequestRecord
    receive: Receive
    target: Target
    stream: bool = False
    strip_usage: bool = False
    shape: WireShape = CHAT
    method: str = "POST"
    engine_headers: Mapping[str, str] | None = None
    watch: DisconnectWatch | None = None
    lease: HeldLease | None = None
    admitting: asyncio.Task[None] | None = None
    after: AfterSettle | None = None
    response_fields: Mapping[str, Any] | None = None
    retarget: Retarget | None = None
    picked: Picked | None = None


# The engine failures before its answer's first byte that another replica is tried for.
_FAILOVER_ERRORS = (EngineRefusedError, EngineConnectionLostError)


class EngineRelay:
    """Runs the exchange of one completion request with the engine (see the module docstring)."""

    def __init__(self, settings: RelaySettings, metrics: GatewayMetrics) -> None:
        self._settings = settings
        self._metrics = metrics

    async def forward(self, exchange: Exchange) -> ASGIApp:
        """Send the exchange's body to the engine: the answer as an ASGI app, or a GatewayError (5xx).

        Its admission, where it runs beside the exchange, is waited for before anything reaches the client: its
        refusal ends the exchange (the engine aborts the request) and is raised in its place. The exchange is settled
        exactly once (`Settlement`: the lease released, then the route's own step run): when the answer is read, when
        the stream ends, or on the error. The lease's headers (the key's rate-limit headers) go on the answer.
        """
        record, lease, admitting, shape = exchange.record, exchange.lease, exchange.admitting, exchange.shape
        settlement = Settlement(record, lease, exchange.after, exchange.target.errors)
        try:
            reading = self._open_with_failover(exchange, settlement)
            if admitting is not None:
                reading = _beside(admitting, reading)
            target, upstream, answer = await run_until_disconnect(exchange.receive, reading, exchange.watch)
            if admitting is not None:
                await _admitted(admitting, upstream)
        except ClientDisconnectedError:
            record.client_disconnected = True
            self._metrics.client_disconnects.labels("non_stream").inc()
            await settlement.settle()
            return BufferedAnswer(CLIENT_CLOSED_REQUEST, b"", None, {})
        except BaseException:
            await settlement.settle()
            raise
        headers = lease.headers if lease is not None else {}
        if upstream.status != 200:
            record.engine_error = EngineErrorKind.ERROR_STATUS
            await settlement.settle()
            if upstream.status in ENGINE_KEY_REFUSED:  # the gateway's own key, not the client's: never a 401
                raise EngineCredentialsError(ENGINE_KEY_MESSAGE, retry_after=self._settings.retry_after)
            if upstream.status == ENGINE_BUSY:  # vLLM's own queue bound (--max-num-queued-reqs): our envelope
                self._metrics.admission_refused.labels(target.url, record.model or "", "all", "engine_queue").inc()
                raise EngineBusyError(
                    "The model engine's queue is full; retry shortly.", retry_after=self._settings.retry_after
                )
            if upstream.status >= 500 and ENGINE_DEAD in (answer or b""):
                raise EngineUnavailableError(ENGINE_DEAD_MESSAGE, retry_after=self._settings.retry_after)
            error_body = shape.engine_error_body(upstream.status, answer or b"")
            return BufferedAnswer(upstream.status, error_body, "application/json", headers)
        if answer is not None:
            return await self._answered(target, upstream, answer, record, headers, settlement, exchange.response_fields)
        return SSERelay(
            upstream,
            record,
            self._settings,
            self._metrics,
            strip_usage=exchange.strip_usage,
            shape=shape,
            headers=[(name.encode("latin-1"), value.encode("latin-1")) for name, value in headers.items()],
            settlement=settlement,
            activity=target.activity,
            response_fields=exchange.response_fields,
        )

    async def _answered(
        self,
        target: Target,
        upstream: UpstreamResponse,
        answer: bytes,
        record: RequestRecord,
        headers: Mapping[str, str],
        settlement: Settlement,
        response_fields: Mapping[str, Any] | None,
    ) -> BufferedAnswer:
        target.activity.progress()
        try:
            parsed = orjson.loads(answer)
        except orjson.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict):
            if response_fields and parsed.get("object") == "response":
                parsed.update(response_fields)
                answer = orjson.dumps(parsed)
            record.take_answer(parsed)
            if record.trace is not None:
                record.trace.read(parsed)
        await settlement.settle()
        return BufferedAnswer(200, answer, upstream.content_type, headers)

    async def _open_with_failover(
        self, exchange: Exchange, settlement: Settlement
    ) -> tuple[Target, UpstreamResponse, bytes | None]:
        """`_open_and_read` on the exchange's replica; when it refuses or resets the connection, or answers that its
        queue is full, before anything was read of an answer, once more on another replica of the model (the
        request is charged once: its lease is the same). The replica that answered, and its answer."""
        target, record = exchange.target, exchange.record
        for attempt in (1, 2):
            retarget = exchange.retarget if attempt == 1 else None
            try:
                upstream, answer = await self._open_and_read(
                    target,
                    exchange.path,
                    exchange.body,
                    record,
                    read_body=not exchange.stream,
                    method=exchange.method,
                    headers=exchange.engine_headers,
                    picked=exchange.picked,
                )
            except _FAILOVER_ERRORS as refused:
                other = retarget(target) if retarget is not None else None
                if other is None:
                    raise
                kind = record.engine_error
                if kind is not None:
                    target.errors[kind].inc()  # the refusing replica's failure, counted where it happened
                logger.warning("replica %s failed before its answer (%s): tried on %s", target.url, refused, other.url)
            else:
                if upstream.status != ENGINE_BUSY or retarget is None:
                    return target, upstream, answer
                other = retarget(target)
                if other is None:
                    return target, upstream, answer
                upstream.close()
                logger.info("replica %s answered that its queue is full: tried on %s", target.url, other.url)
            record.engine_error = None
            record.replica, record.routed = other.url, "failover"
            self._metrics.routed.labels(record.model or "", "failover").inc()
            target = other
            settlement.errors = other.errors
        raise AssertionError("unreachable: the second attempt returns or raises")

    async def _open_and_read(
        self,
        target: Target,
        path: str,
        body: bytes,
        record: RequestRecord,
        *,
        read_body: bool,
        method: str = "POST",
        headers: Mapping[str, str] | None = None,
        picked: Picked | None = None,
    ) -> tuple[UpstreamResponse, bytes | None]:
        """Open the engine request on `target` and read its whole body (unless it is a stream that started well);
        `picked`, the request's pick, is counted as its exchange from then on.

        Engine failures are recorded on `record` by kind; a refused connection also marks the replica down.
        """
        # The client's id stays the client's (echoed to it, logged); the engine gets one no one else can send.
        record.engine_request_id = f"{record.request_id}-{os.urandom(4).hex()}"
        waiter = _Waiter()
        activity = target.activity
        activity.begin(waiter, picked)
        try:
            upstream = await target.client.open(path, body, record.engine_request_id, method=method, headers=headers)
            record.engine_connected_at, record.engine_answered_at = upstream.connected_at, time.perf_counter()
            if not read_body and upstream.status == 200:
                return upstream, None
            return upstream, await target.client.read_body(upstream)
        except GatewayError as exc:
            record.engine_error = error_kind(exc)
            if record.engine_error is EngineErrorKind.REFUSED:
                target.monitor.mark_refused()
            logger.warning(
                "engine request %s (client id %s) failed: %s", record.engine_request_id, record.request_id, exc.message
            )
            raise
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not waiter.frozen or task is None or task.uncancel() > 0:
                raise
            record.engine_error = EngineErrorKind.FROZEN
            raise EngineUnavailableError(
                "The model engine stopped generating; the request was ended. Retry shortly.",
                retry_after=self._settings.retry_after,
            ) from None
        finally:
            activity.end(waiter)
