"""The OpenAI routes: /v1/chat/completions, /v1/completions, /v1/models.

Handlers stay short: authenticate, read, prepare, check the model, admit, and hand the exchange to
the engine relay (`relay/exchange.py`). The two completion handlers are dispatched by
`app._Dispatcher` (no router, no FastAPI body parsing or dependency solving on the hot path)
and answer with an ASGI app: the engine's whole answer, or for streams the SSE relay.
"""

from __future__ import annotations

import functools

import orjson
from fastapi import APIRouter, Request, Response

from gateway.auth import ApiKey
from gateway.deps import get_record, get_services, require_api_key
from gateway.errors import GatewayError, RequestTooLargeError
from gateway.ratelimit import Lease
from gateway.services import Services
from gateway.types import ASGIApp
from gateway.validation import Prepare, PreparedRequest, effective_priority, prepare_chat, prepare_completion

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


async def _relay(request: Request, path: str, prepare: Prepare) -> ASGIApp:
    services = get_services(request)
    record = get_record(request)
    key = await require_api_key(request, services)
    if key is not None:
        # A key already refused for requests/min or concurrency is refused again before its body is read:
        # an over-limit client must not make the gateway read and parse megabytes first.
        services.limiter.precheck(key)
    body = await _read_body(request, services.settings.max_body_bytes)
    prepared = prepare(body, services.settings, await services.monitor.require_ready())
    record.model, record.stream = prepared.model, prepared.stream
    lease = None
    if key is not None:
        services.keys.check_model(key, prepared.model)
        lease = await services.limiter.acquire(key, prepared.tokens_estimate)
    body = await _admit(services, key, prepared, lease)
    return await services.relay.forward(
        path,
        body,
        record,
        request.receive,
        stream=prepared.stream,
        strip_usage=not prepared.client_wants_usage,
        headers=lease.headers if lease is not None else {},
        settle=functools.partial(services.limiter.release, lease) if lease is not None else None,
    )


async def _admit(services: Services, key: ApiKey | None, prepared: PreparedRequest, lease: Lease | None) -> bytes:
    """Admit the request at its priority against the engine's queue (its key's lease refunded when refused); the
    body for the engine, with `priority` only for an engine that schedules by it."""
    priority = effective_priority(
        key.priority if key is not None else None,
        services.settings.limits.default_priority,
        prepared.requested_priority,
    )
    try:
        await services.admission.admit(priority)
    except GatewayError:
        if lease is not None:
            await services.limiter.release(lease, 0)
        raise
    scheduling = services.monitor.priority_scheduling
    services.admission.count_sent(priority, sent=scheduling)
    return prepared.engine_body(priority if scheduling else None)


async def chat_completions(request: Request) -> ASGIApp:
    """POST /v1/chat/completions: validated, policy applied, relayed (streamed or not)."""
    return await _relay(request, "/v1/chat/completions", prepare_chat)


async def completions(request: Request) -> ASGIApp:
    """POST /v1/completions: validated, policy applied, relayed (streamed or not)."""
    return await _relay(request, "/v1/completions", prepare_completion)


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    """GET /v1/models: the engine's list, with the configured aliases as further entries."""
    services = get_services(request)
    await require_api_key(request, services)
    info = await services.monitor.require_ready()
    listing = await services.engine.get_json("/v1/models", services.settings.relay.probe_timeout)
    entries = listing.get("data", []) if isinstance(listing, dict) else []
    served = next((e for e in entries if isinstance(e, dict) and e.get("id") == info.name), None)
    if served is not None:
        entries.extend({**served, "id": alias} for alias in services.settings.model_aliases)
    return Response(orjson.dumps({"object": "list", "data": entries}), media_type="application/json")
