"""Stored Responses API answers: who may read, continue or cancel one, and the routes that do.

vLLM keeps a response (in its memory) only when the operator turned its store on (`engine.responses_store`);
otherwise the requests that need one get a clear 400 (validation) or 404 (here). With the store on, the id of
every response is mapped to the key that created it (`auth.ResponseOwners`: the key's record, kept by a rotation, not
its name; never the secret), for `engine.responses_store_ttl`; another key's id, or an unknown one, is a 404 as OpenAI
answers it. Reading or cancelling one counts against the key's requests/min and concurrency like any request (its
lease held until the exchange settles, a streamed replay's end included) and charges no tokens: nothing is generated.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import Request

from gateway.api.context import get_record, get_services, require_api_key
from gateway.api.validation import STORE_OFF, PreparedRequest, parse_json_object
from gateway.auth import ApiKey
from gateway.errors import InvalidRequestError, KeyStoreUnavailableError, ResponseNotFoundError
from gateway.ratelimit import RequestLease
from gateway.relay.disconnect import disconnect_watch
from gateway.relay.exchange import Exchange
from gateway.relay.shapes import RESPONSES
from gateway.request_record import RequestRecord
from gateway.services import Services
from gateway.types import ASGIApp

# Response ids are vLLM's `resp_<hex>`; anything else is not one, and never reaches Redis or the engine.
_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


def _owner(key: ApiKey | None) -> str:
    # With auth off there is one caller: every response is its own.
    return key.key_id if key is not None else "-"


async def _check_owner(services: Services, key: ApiKey | None, response_id: str, param: str | None) -> None:
    missing = ResponseNotFoundError(f"No response found with id {response_id[:80]!a}.", param=param)
    if len(response_id) > 128 or not set(response_id) <= _ID_CHARS:
        raise missing
    if await services.owners.owner(response_id) != _owner(key):
        raise missing


async def remember_owner(
    request: Request, key: ApiKey | None, prepared: PreparedRequest, record: RequestRecord
) -> Callable[[], Awaitable[None]] | None:
    """POST /v1/responses with the store on: a `previous_response_id` must be the key's own; the new response's id
    is remembered as the key's once the exchange ends."""
    services = get_services(request)
    if not services.settings.engine.responses_store:
        return None
    previous = parse_json_object(prepared.body).get("previous_response_id")
    if isinstance(previous, str):
        await _check_owner(services, key, previous, "previous_response_id")

    async def remember() -> None:
        if record.response_id is None:
            return
        try:
            await services.owners.remember(record.response_id, _owner(key))
        except KeyStoreUnavailableError:
            # The answer is out already; the response is then only unreadable later (a 404), never another's.
            pass

    return remember


def _response_id(request: Request) -> str:
    # /v1/responses/{id} or /v1/responses/{id}/cancel
    return request.url.path.split("/")[3]


def _stored_query(request: Request) -> dict[str, str]:
    """The query values the engine reads on GET /v1/responses/{id}, checked: `stream` true or false, `starting_after`
    a whole number in ASCII digits (`isdigit` alone takes other scripts' digits, which cannot go on the engine's
    request line); others are dropped."""
    query = {k: v for k, v in request.query_params.items() if k in ("stream", "starting_after")}
    stream = query.get("stream")
    if stream is not None:
        if stream.lower() not in ("true", "false"):
            raise InvalidRequestError(f"'stream' is {stream[:40]!a}; send true or false.", param="stream")
        query["stream"] = stream.lower()
    after = query.get("starting_after")
    if after is not None and not (after.isascii() and after.isdigit() and len(after) <= 18):
        raise InvalidRequestError(
            f"'starting_after' is {after[:40]!a}; send the sequence number of an event (a whole number from 0).",
            param="starting_after",
        )
    return query


def _engine_path(request: Request, response_id: str, *, cancel: bool) -> tuple[str, bool]:
    """The engine's path for reading or cancelling `response_id` (with the checked query), and whether the answer is
    a stream (a replay of the response's events)."""
    path = f"/v1/responses/{response_id}" + ("/cancel" if cancel else "")
    if cancel:
        return path, False
    query = _stored_query(request)
    if query:
        path += "?" + "&".join(f"{k}={v}" for k, v in query.items())
    return path, query.get("stream") == "true"


async def _stored(request: Request, *, cancel: bool) -> ASGIApp:
    services = get_services(request)
    record = get_record(request)
    key = await require_api_key(request, services)
    lease = RequestLease(services.limiter, key, record.api or "responses") if key is not None else None
    if lease is not None:
        lease.precheck()
    response_id = _response_id(request)
    if not services.settings.engine.responses_store:
        raise ResponseNotFoundError(STORE_OFF.format(what="reading or cancelling a stored response"))
    await _check_owner(services, key, response_id, None)
    await services.monitor.require_ready()
    path, stream = _engine_path(request, response_id, cancel=cancel)
    record.stream, record.replay = stream, True
    if lease is not None:
        await lease.acquire(0)  # a request, a concurrency slot until the exchange settles; no tokens
    return await services.relay.forward(
        Exchange(
            path,
            b"",
            record,
            request.receive,
            stream=stream,
            shape=RESPONSES,
            method="POST" if cancel else "GET",
            watch=disconnect_watch(request.scope),
            lease=lease,
        )
    )


async def retrieve(request: Request) -> ASGIApp:
    """GET /v1/responses/{id}: a stored response (or its events, `?stream=true`), for the key that created it."""
    return await _stored(request, cancel=False)


async def cancel(request: Request) -> ASGIApp:
    """POST /v1/responses/{id}/cancel: cancel a stored background response of the key that created it."""
    return await _stored(request, cancel=True)
