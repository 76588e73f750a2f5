"""The OpenAI routes: /v1/chat/completions, /v1/completions, /v1/models.

Handlers stay short: authenticate, read, prepare, check the model, admit, and hand the exchange to
the engine relay (`relay/exchange.py`). The two completion handlers are dispatched by
`app._Dispatcher` (no router, no FastAPI body parsing or dependency solving on the hot path)
and answer with an ASGI app: the engine's whole answer, or for streams the SSE relay.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import orjson
from fastapi import APIRouter, Request, Response

from gateway.deps import get_record, get_services, require_api_key
from gateway.errors import RequestTooLargeError
from gateway.ratelimit import Lease, RateLimiter, TokenDetail
from gateway.requestlog import RequestRecord
from gateway.types import ASGIApp
from gateway.validation import Prepare, prepare_chat, prepare_completion

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
        # The API is the route's metric label (the served path), so usage by API counts every route that relays.
        lease = await services.limiter.acquire(key, prepared.tokens_estimate, path)
    return await services.relay.forward(
        path,
        prepared.body,
        record,
        request.receive,
        stream=prepared.stream,
        strip_usage=not prepared.client_wants_usage,
        headers=lease.headers if lease is not None else {},
        settle=_settle(services.limiter, lease, record) if lease is not None else None,
    )


def _settle(limiter: RateLimiter, lease: Lease, record: RequestRecord) -> Callable[[int | None], Awaitable[None]]:
    """Release `lease` with the tokens the engine reported on `record`, read when the exchange ends."""

    async def settle(used: int | None) -> None:
        detail = TokenDetail(record.prompt_tokens, record.completion_tokens, record.reasoning_tokens)
        await limiter.release(lease, used, detail)

    return settle


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
