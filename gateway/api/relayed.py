"""The relayed API routes (chat and text completions, the Responses API, Anthropic's Messages API) and
/v1/models.

`relay` is the one handler of every relayed route the table declares (gateway/api/table.py): authenticate,
read, prepare, check the model, admit, and hand the exchange to the engine relay (`relay/exchange.py`). It is
dispatched by `app._Dispatcher` (no router, no FastAPI body parsing or dependency solving on the hot path)
and answers with an ASGI app: the engine's whole answer, or for streams the SSE relay.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
from fastapi import APIRouter, Request, Response

from gateway.api.context import get_background, get_record, get_services, require_api_key
from gateway.api.conversation import Turn
from gateway.api.validation import Prepare, PreparedRequest, effective_priority
from gateway.auth import ApiKey
from gateway.errors import NotFoundError, QuotaExceededError, RequestTooLargeError
from gateway.pool.replica import Replica
from gateway.ratelimit import EffectiveLimits, RequestLease
from gateway.relay.activity import Picked
from gateway.relay.disconnect import disconnect_watch
from gateway.relay.exchange import Exchange
from gateway.relay.shapes import WireShape
from gateway.request_record import RequestRecord
from gateway.services import Services
from gateway.types import ASGIApp

router = APIRouter()


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestTooLargeError(f"The request body is {declared} bytes; the limit is {limit} bytes.")
    parts: list[bytes] = []
    size = 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise RequestTooLargeError(f"The request body is larger than the limit of {limit} bytes.")
        parts.append(part)
    return b"".join(parts)


# A route's stored state, read before its body is prepared (the Responses API's: `api/conversation.py`).
BeginTurn = Callable[[Request, ApiKey | None, bytes], Awaitable[Turn]]


# vLLM's header for a request's priority (0.32: read before the body's `priority` by every generating route, and
# the only way to give one to its Messages API, whose request model has no `priority` field).
PRIORITY_HEADER = "X-Vllm-Priority"


@dataclass(frozen=True, slots=True)
class Relayed:
    """How one API is relayed: the engine path, the body's preparation, the wire shape, the client headers
    passed on to the engine, the stored state it keeps (`begin_turn`), and where its engine reads a priority from
    (the body's `priority`, or `priority_header` where the engine's request model has no such field)."""

    path: str
    prepare: Prepare
    shape: WireShape
    passed_headers: tuple[str, ...] = ()
    begin_turn: BeginTurn | None = None
    priority_header: bool = False

    def engine_request(
        self, request: Request, prepared: PreparedRequest, priority: int | None
    ) -> tuple[bytes, dict[str, str]]:
        """The body and the headers for the engine: the passed client headers, and `priority` (None: none sent)
        where this API's engine reads it."""
        headers = {name: value for name in self.passed_headers if (value := request.headers.get(name))}
        if priority is None or not self.priority_header:
            return prepared.engine_body(priority), headers
        headers[PRIORITY_HEADER] = str(priority)
        return prepared.engine_body(None), headers


async def relay(request: Request, api: Relayed) -> ASGIApp:
    """Any relayed route: validated, policy applied, admitted against the key's limits, relayed (streamed or not)."""
    services = get_services(request)
    record = get_record(request)
    trace = record.trace = services.tracer.begin(request.headers) if services.tracer is not None else None
    key = await require_api_key(request, services)
    record.key_checked_at = time.perf_counter()
    # Usage by API is kept under the route's API label (chat, responses, ...), so every relayed route counts.
    lease = RequestLease(services.limiter, key, record.api or api.path) if key is not None else None
    if lease is not None:
        # A key already refused for requests/min or concurrency is refused again before its body is read:
        # an over-limit client must not make the gateway read and parse megabytes first.
        lease.precheck()
    body = await _read_body(request, services.settings.max_body_bytes)
    served = await services.pool.served()
    turn = await api.begin_turn(request, key, body) if api.begin_turn is not None else None
    prepared = (api.prepare if turn is None else turn.prepare)(body, services.settings, served)
    record.model, record.stream, record.prepared_at = prepared.model, prepared.stream, time.perf_counter()
    if key is not None:
        services.keys.check_model(key, prepared.model)
        prepared = prepared.capped(_token_limit(services.limiter.effective_limits(key)), prepared.context_length)
    if turn is not None and turn.background:
        # Counted like any request: admitted against the key's limits now, run by the gateway (its lease held).
        if lease is not None:
            prepared = await _acquire(lease, prepared)
        priority = _priority(services, key, prepared)
        affinity = affinity_key(request, services, key, prepared)
        return await get_background(request).create(turn, prepared, priority, key, lease, record, affinity)
    replica, picked = route(services, record, prepared, affinity_key(request, services, key, prepared))
    try:
        after = turn.keeper(record) if turn is not None else None
        admitting = None
        if lease is not None:
            # A key admitted last time goes on to the engine while Redis decides (the answer waits for it), unless the
            # engine's queue must admit it first or the route has a step of its own to run once admitted.
            # A cap of the gateway's may yet be lowered to what a budget has left: that needs the answer first.
            if after is None and not replica.admission.enabled and prepared.gateway_cap_field is None:
                admitting = lease.acquire_beside(prepared.tokens_estimate)
            if admitting is None:
                prepared = await _acquire(lease, prepared)
        engine_body, engine_headers = api.engine_request(
            request, prepared, await _admit(services, replica, key, prepared, lease, record)
        )
        if trace is not None:
            sent_at = time.perf_counter()
            trace.sending(engine_headers, sent_at, prepared.max_tokens, engine_body, generates=prepared.generates)
        return await services.relay.forward(
            Exchange(
                api.path,
                engine_body,
                record,
                request.receive,
                stream=prepared.stream,
                strip_usage=not prepared.client_wants_usage,
                shape=api.shape,
                engine_headers=engine_headers,
                watch=disconnect_watch(request.scope),
                lease=lease,
                admitting=admitting,
                after=after,
                response_fields=turn.response_fields if turn is not None else None,
                target=replica,
                retarget=services.pool.retarget(prepared.model),
                picked=picked,
            )
        )
    finally:
        picked.release()  # opened its exchange by now, or never will (refused, failed)


def affinity_key(request: Request, services: Services, key: ApiKey | None, prepared: PreparedRequest) -> bytes:
    """The request's replica affinity: a digest of its key's record id with the session header's value when it
    sends one, else with the conversation's leading messages (the same for every turn of one conversation, whether
    its history is sent again or continued from a stored response, in the foreground or in the background). A
    short digest: a background response's job keeps it, and the picker hashes it once a replica."""
    owner = (key.key_id if key is not None else "-").encode()
    session = request.headers.get(services.settings.routing.session_header)
    if session:
        start = owner + b"\0session\0" + session.encode("utf-8", "replace")
    else:
        start = owner + b"\0" + prepared.leading
    return hashlib.blake2b(start, digest_size=16).digest()


def route(
    services: Services, record: RequestRecord, prepared: PreparedRequest, affinity: bytes | None
) -> tuple[Replica, Picked]:
    """A ready replica of the request's model, by its picker (503 when none is ready); noted on `record` and
    counted; and its pick, counted in the replica's load from now on (for the next request's picker, in every
    worker) until the caller releases it, when the request's exchange opens or it is refused."""
    replica, how = services.pool.pick(prepared.model, affinity)
    record.replica, record.routed = replica.url, how
    services.metrics.routed.labels(prepared.model, how).inc()
    return replica, replica.activity.picked()


async def _acquire(lease: RequestLease, prepared: PreparedRequest) -> PreparedRequest:
    """Admit `prepared`, charging its estimate; a budget that refuses a length the gateway chose is asked once more
    for the length it has left (the request as admitted is returned)."""
    try:
        await lease.acquire(prepared.tokens_estimate)
        return prepared
    except QuotaExceededError as refusal:
        smaller = prepared.recapped(refusal.tokens_left)
        if smaller is None:
            raise
    await lease.acquire(smaller.tokens_estimate)
    return smaller


def _token_limit(limits: EffectiveLimits) -> int | None:
    """The most tokens one request of a key can be charged: its smallest token limit (tokens/min, the daily and the
    monthly budget), None when it has none. A request that leaves its length to the engine is capped to fit it."""
    bounds = [limit for limit in (limits.tokens_per_minute, limits.daily_tokens, limits.monthly_tokens) if limit]
    return min(bounds) if bounds else None


async def _admit(
    services: Services,
    replica: Replica,
    key: ApiKey | None,
    prepared: PreparedRequest,
    lease: RequestLease | None,
    record: RequestRecord,
) -> int | None:
    """Admit the request at its priority (kept on `record`) against its replica's queue (its lease released
    uncharged when refused); the priority to send the engine: None unless it schedules by priority."""
    if not prepared.generates:
        # Counting tokens takes no place in the engine's queue: counted there, it would refuse other keys'
        # generations until the next scrape of the engine's gauges.
        return None
    priority = record.priority = _priority(services, key, prepared)
    try:
        await replica.admission.admit(priority)
        scheduling = replica.monitor.priority_scheduling
        replica.admission.count_sent(priority, sent=scheduling)
        return priority if scheduling else None
    except BaseException:
        # Refused (or cancelled) before the engine: the key's request is given back, and an admission still running
        # beside it is waited for, so that nothing it takes stays held.
        if lease is not None:
            await lease.release(0, served=False)
        raise


def _priority(services: Services, key: ApiKey | None, prepared: PreparedRequest) -> int:
    """The priority `prepared` is served at (its key's, or the client's less urgent one)."""
    return effective_priority(
        key.priority if key is not None else None,
        services.settings.limits.default_priority,
        prepared.requested_priority,
    )


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    """GET /v1/models: every model a ready replica serves (the engines' own entries), with the configured aliases
    as further entries of the first; a key limited to some models sees those only."""
    services = get_services(request)
    key = await require_api_key(request, services)
    entries = await _model_entries(services, key)
    return Response(orjson.dumps({"object": "list", "data": entries}), media_type="application/json")


async def retrieve_model(request: Request) -> ASGIApp:
    """GET /v1/models/{model} (the OpenAI SDK's `models.retrieve`; a model id may hold slashes): the model's entry,
    or 404 in OpenAI's envelope for a model not served here or not open to the key."""
    services = get_services(request)
    key = await require_api_key(request, services)
    wanted = request.url.path.removeprefix(_MODEL_PATH)
    entry = next((e for e in await _model_entries(services, key) if e.get("id") == wanted), None)
    if entry is None:
        raise NotFoundError(f"The model {wanted!r} does not exist here.", param="model")
    return Response(orjson.dumps(entry), media_type="application/json")


_MODEL_PATH = "/v1/models/"


async def _model_entries(services: Services, key: ApiKey | None) -> list[dict[str, Any]]:
    """The /v1/models entries: each served model's entry as one of its ready replicas lists it (asked of every
    model's replica at once), the aliases after the first model's, those `key` may not use left out."""
    served = await services.pool.served()
    ready = services.pool.ready_models()
    names = [model.name for model in served.models if model.name in ready]
    if key is not None and key.models is not None:
        names = [name for name in names if name in key.models]
    within = services.settings.relay.probe_timeout
    listings = await asyncio.gather(*(ready[name][0].client.get_json("/v1/models", within) for name in names))
    entries: list[dict[str, Any]] = []
    for name, listing in zip(names, listings, strict=True):
        found = listing.get("data", []) if isinstance(listing, dict) else []
        entry = next((e for e in found if isinstance(e, dict) and e.get("id") == name), None)
        if entry is None:  # the operator renamed the local engine's model (`model_name`): its first entry, renamed
            first = next((e for e in found if isinstance(e, dict)), {"object": "model", "owned_by": "vllm"})
            entry = {**first, "id": name}
        entries.append(entry)
        if served.models and name == served.models[0].name:
            entries.extend({**entry, "id": alias} for alias in services.settings.model_aliases)
    return entries
