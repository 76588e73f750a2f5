"""The OpenAI routes: /v1/chat/completions, /v1/completions, /v1/models.

Handlers stay short: they call validation, the engine client and the SSE relay. The two completion
handlers are dispatched by `app._CompletionRoutes` (no router, no FastAPI body parsing or dependency
solving on the hot path) and answer with a Response or, for streams, the SSE relay (an ASGI app).
"""

from __future__ import annotations

from collections.abc import Callable

import orjson
from fastapi import APIRouter, Request, Response

from gateway.deps import get_record, get_services, require_api_key
from gateway.errors import EngineRefusedError, EngineUnavailableError, RequestTooLargeError
from gateway.ratelimit import Lease
from gateway.relay.client import UpstreamResponse, engine_error_body
from gateway.relay.model import ModelInfo
from gateway.relay.sse import ClientDisconnectedError, SSERelay, run_until_disconnect
from gateway.requestlog import RequestRecord
from gateway.services import Services
from gateway.settings import Settings
from gateway.validation import PreparedRequest, prepare_chat, prepare_completion

router = APIRouter()

Prepare = Callable[[bytes, Settings, ModelInfo], PreparedRequest]


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


async def _open(services: Services, path: str, prepared: PreparedRequest, record: RequestRecord) -> UpstreamResponse:
    try:
        return await services.engine.open(path, prepared.body, record.request_id)
    except EngineUnavailableError as exc:
        if isinstance(exc, EngineRefusedError):
            services.monitor.mark_down(exc.message)
        services.metrics.engine_errors.labels("unavailable").inc()
        raise


async def _complete(
    services: Services, path: str, prepared: PreparedRequest, record: RequestRecord
) -> tuple[UpstreamResponse, bytes]:
    upstream = await _open(services, path, prepared, record)
    try:
        return upstream, await services.engine.read_body(upstream)
    except BaseException:
        upstream.close()
        raise


def _engine_error(status: int, answer: bytes, headers: dict[str, str]) -> Response:
    return Response(engine_error_body(status, answer), status, headers=headers, media_type="application/json")


async def _relay(request: Request, path: str, prepare: Prepare) -> Response | SSERelay:
    services = get_services(request)
    record = get_record(request)
    key = await require_api_key(request, services)
    body = await _read_body(request, services.settings.max_body_bytes)
    prepared = prepare(body, services.settings, services.monitor.require_ready())
    record.model, record.stream = prepared.model, prepared.stream
    lease = None
    if key is not None:
        services.keys.check_model(key, prepared.model)
        lease = await services.limiter.acquire(key, prepared.tokens_estimate)
    try:
        response = await _forward(request, services, path, prepared, record, lease)
    except BaseException:
        await _release(services, lease, record, reached_engine=False)
        raise
    if not isinstance(response, SSERelay):
        await _release(services, lease, record, reached_engine=True)
    return response


async def _release(services: Services, lease: Lease | None, record: RequestRecord, *, reached_engine: bool) -> None:
    """Give back the concurrency slot and settle the token charge with what the engine reported.

    Unknown usage keeps the estimate when the engine may have worked (a disconnect mid-stream) and is
    refunded when it never did.
    """
    if lease is None:
        return
    used = record.total_tokens
    if used is None and (not reached_engine or record.engine_error == "refused"):
        used = 0
    await services.limiter.release(lease, used)


async def _forward(
    request: Request,
    services: Services,
    path: str,
    prepared: PreparedRequest,
    record: RequestRecord,
    lease: Lease | None,
) -> Response | SSERelay:
    headers = lease.headers if lease is not None else {}
    try:
        if not prepared.stream:
            upstream, answer = await run_until_disconnect(request.receive, _complete(services, path, prepared, record))
            if upstream.status != 200:
                record.engine_error = "refused"
                return _engine_error(upstream.status, answer, headers)
            record.take_usage(orjson.loads(answer).get("usage"))
            return Response(answer, 200, headers=headers, media_type=upstream.content_type)
        upstream = await run_until_disconnect(request.receive, _open(services, path, prepared, record))
    except ClientDisconnectedError:
        record.client_disconnected = True
        services.metrics.client_disconnects.labels("non_stream").inc()
        return Response(status_code=499)
    if upstream.status != 200:
        record.engine_error = "refused"
        return _engine_error(upstream.status, await services.engine.read_body(upstream), headers)

    async def finished() -> None:
        await _release(services, lease, record, reached_engine=True)

    relay = SSERelay(
        upstream,
        record,
        services.settings.relay,
        services.metrics,
        strip_usage=not prepared.client_wants_usage,
        headers=[(name.encode(), value.encode()) for name, value in headers.items()],
        on_finish=finished,
    )
    return relay


async def chat_completions(request: Request) -> Response | SSERelay:
    """POST /v1/chat/completions: validated, policy applied, relayed (streamed or not)."""
    return await _relay(request, "/v1/chat/completions", prepare_chat)


async def completions(request: Request) -> Response | SSERelay:
    """POST /v1/completions: validated, policy applied, relayed (streamed or not)."""
    return await _relay(request, "/v1/completions", prepare_completion)


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    """GET /v1/models: the engine's list, with the configured aliases as further entries."""
    services = get_services(request)
    await require_api_key(request, services)
    info = services.monitor.require_ready()
    listing = await services.engine.get_json("/v1/models", services.settings.relay.probe_timeout)
    entries = listing.get("data", []) if isinstance(listing, dict) else []
    served = next((e for e in entries if isinstance(e, dict) and e.get("id") == info.name), None)
    if served is not None:
        entries.extend({**served, "id": alias} for alias in services.settings.model_aliases)
    return Response(orjson.dumps({"object": "list", "data": entries}), media_type="application/json")
