"""The stored Responses API routes: retrieve, delete, list the input items of and cancel a response.

Every one answers from the gateway's store (`responses.ResponseStore`, Redis), never from an engine, and only for the
key that made the response (`conversation.owner_of`): another key's id, like an unknown, expired or deleted one, is a
404 as OpenAI answers it. Each counts against the key's requests/min and concurrency like any request (its lease held
until the answer is out, a followed stream's end included) and charges no tokens: nothing is generated. A background
response's events are replayed from `starting_after` and followed until it finishes (`replay`).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import orjson
from fastapi import Request

from gateway.api.context import get_background, get_record, get_services, require_api_key
from gateway.api.conversation import UNFINISHED, checked_id, not_found, owner_of
from gateway.errors import InvalidRequestError
from gateway.ratelimit import RequestLease
from gateway.relay.disconnect import ClientDisconnectedError, run_until_disconnect
from gateway.relay.exchange import BufferedAnswer
from gateway.relay.shapes import RESPONSES
from gateway.relay.sse import KEEP_ALIVE, SSE_HEADERS
from gateway.responses import ResponseStore, StoredResponse
from gateway.types import ASGIApp, Receive, Scope, Send

# How often a followed background response is looked at for new events, and after how long without any the
# follower sends a keep-alive.
_FOLLOW_INTERVAL = 0.2
_KEEP_ALIVE_AFTER = 10.0
_MAX_LIST = 100


def _response_id(request: Request) -> str:
    # /v1/responses/{id}, /v1/responses/{id}/cancel, /v1/responses/{id}/input_items
    return checked_id(request.url.path.split("/")[3])


def _whole_number(request: Request, name: str, most: int, least: int = 0) -> int | None:
    value = request.query_params.get(name)
    if value is None:
        return None
    if not (value.isascii() and value.isdigit() and len(value) <= 18) or not least <= int(value) <= most:
        raise InvalidRequestError(
            f"'{name}' is {value[:40]!a}; send a whole number from {least} to {most}.", param=name
        )
    return int(value)


def _choice(request: Request, name: str, allowed: tuple[str, ...], default: str) -> str:
    value = request.query_params.get(name, default)
    if value.lower() not in allowed:
        raise InvalidRequestError(f"'{name}' is {value[:40]!a}; send {' or '.join(allowed)}.", param=name)
    return value.lower()


async def _stored(request: Request) -> tuple[StoredResponse, ResponseStore, str, RequestLease | None]:
    """The caller's stored response of this path, its lease admitted (a request, a concurrency slot, no tokens)."""
    services = get_services(request)
    record = get_record(request)
    key = await require_api_key(request, services)
    lease = RequestLease(services.limiter, key, record.api or "responses") if key is not None else None
    if lease is not None:
        lease.precheck()
    response_id = _response_id(request)
    owner = owner_of(key)
    stored = await services.responses.get(response_id, owner)
    if stored is None:
        raise not_found(response_id)
    record.replay = True
    if lease is not None:
        await lease.acquire(0)
    return stored, services.responses, owner, lease


async def _answer(body: dict[str, Any], lease: RequestLease | None, request: Request) -> ASGIApp:
    if lease is not None:
        await lease.release(0, get_record(request))
    return BufferedAnswer(200, orjson.dumps(body), "application/json", lease.headers if lease else {})


async def retrieve(request: Request) -> ASGIApp:
    """GET /v1/responses/{id}: the key's stored response; `?stream=true` replays a background response's events
    after `starting_after` and follows it until it finishes."""
    stream = _choice(request, "stream", ("true", "false"), "false") == "true"
    after = _whole_number(request, "starting_after", 10**12)
    stored, store, owner, lease = await _stored(request)
    if not stream:
        return await _answer(stored.response, lease, request)
    if stored.response.get("background") is not True:
        if lease is not None:
            await lease.release(0, get_record(request))
        raise InvalidRequestError(
            "Only a background response's events can be streamed again; retrieve it without 'stream'.", param="stream"
        )
    get_record(request).stream = True
    if lease is None:
        return replay(store, stored.response["id"], owner, -1 if after is None else after)
    held = lease

    async def release() -> None:
        await held.release(0, get_record(request))

    return replay(store, stored.response["id"], owner, -1 if after is None else after, release, held.headers)


async def delete(request: Request) -> ASGIApp:
    """DELETE /v1/responses/{id}: delete the key's stored response (a background one still running is stopped)."""
    stored, store, owner, lease = await _stored(request)
    response_id = stored.response["id"]
    if not await store.delete(response_id, owner):
        raise not_found(response_id)
    return await _answer({"id": response_id, "object": "response", "deleted": True}, lease, request)


async def cancel(request: Request) -> ASGIApp:
    """POST /v1/responses/{id}/cancel: stop a background response of the key's; a finished one is answered as it
    is."""
    stored, store, owner, lease = await _stored(request)
    response = stored.response
    if response.get("background") is not True:
        if lease is not None:
            await lease.release(0, get_record(request))
        raise InvalidRequestError("Only a background response can be cancelled.", param="response_id")
    if response.get("status") in UNFINISHED:
        await store.request_cancel(response["id"])
        get_background(request).cancel(response["id"])
        response = {**response, "status": "cancelled"}
        await store.save(owner, response, stored.input_items, previous_response_id=stored.previous_response_id)
    return await _answer(response, lease, request)


def _listed_item(response_id: str, index: int, item: dict[str, Any]) -> dict[str, Any]:
    """An input item as OpenAI lists it: with an id (stable: derived from the response's and its place), a
    message's text as content parts."""
    digest = hashlib.sha256(f"{response_id}:{index}".encode()).hexdigest()[:32]
    listed = {"id": item.get("id") or f"msg_{digest}", **item}
    content = item.get("content")
    if isinstance(content, str):
        part = "output_text" if item.get("role") == "assistant" else "input_text"
        listed["content"] = [{"type": part, "text": content}]
    listed.setdefault("type", "message")
    if listed["type"] == "message":
        listed.setdefault("status", "completed")
    return listed


async def input_items(request: Request) -> ASGIApp:
    """GET /v1/responses/{id}/input_items: the response's own input items, paged as OpenAI pages them (`limit` 1 to
    100, default 20; `order` desc by default; `after` an item id)."""
    limit = _whole_number(request, "limit", _MAX_LIST, least=1)
    order = _choice(request, "order", ("asc", "desc"), "desc")
    after = request.query_params.get("after")
    stored, _store, _owner, lease = await _stored(request)
    response_id = stored.response["id"]
    items = [_listed_item(response_id, i, item) for i, item in enumerate(stored.input_items)]
    if order == "desc":
        items.reverse()
    if after is not None:
        place = next((i for i, item in enumerate(items) if item["id"] == after), None)
        if place is None:
            if lease is not None:
                await lease.release(0, get_record(request))
            raise InvalidRequestError(f"'after' is {after[:80]!a}, not an item of this response.", param="after")
        items = items[place + 1 :]
    page = items[: limit or 20]
    listing = {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > len(page),
    }
    return await _answer(listing, lease, request)


def replay(
    store: ResponseStore,
    response_id: str,
    owner: str,
    after: int,
    release: Callable[[], Awaitable[None]] | None = None,
    headers: Mapping[str, str] | None = None,
) -> ASGIApp:
    """A background response's stream: its events after the `after`th (-1: all), then the new ones as its run
    makes them, until its end (a terminal event, or the response finished, deleted or gone); `release` once over.
    `headers`: the key's rate-limit headers."""
    raw = [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in (headers or {}).items()]

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [*SSE_HEADERS, *raw]})
        try:
            await run_until_disconnect(receive, _follow(store, response_id, owner, after + 1, send))
        except ClientDisconnectedError:
            pass
        finally:
            if release is not None:
                await release()

    return app


async def _follow(store: ResponseStore, response_id: str, owner: str, start: int, send: Send) -> None:
    cursor, quiet_since = start, time.monotonic()
    while True:
        events = await store.events(response_id, cursor)
        for event in events:
            await send({"type": "http.response.body", "body": bytes(event) + b"\n\n", "more_body": True})
            if _ends(bytes(event)):
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
        cursor += len(events)
        if events:
            quiet_since = time.monotonic()
            continue
        stored = await store.get(response_id, owner)
        status = stored.response.get("status") if stored is not None else None
        if status not in UNFINISHED:
            if stored is not None and status == "failed":
                # Failed before the engine answered: no terminal event of its own.
                end = {"type": "response.failed", "response": stored.response}
                body = b"event: response.failed\ndata: %s\n\n" % orjson.dumps(end)
                await send({"type": "http.response.body", "body": body, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        if time.monotonic() - quiet_since > _KEEP_ALIVE_AFTER:
            await send({"type": "http.response.body", "body": KEEP_ALIVE, "more_body": True})
            quiet_since = time.monotonic()
        await asyncio.sleep(_FOLLOW_INTERVAL)


def _ends(event: bytes) -> bool:
    # An event as `_EventLog` keeps it: `event: <type>` on its first line.
    head = event.split(b"\n", 1)[0]
    return head.startswith(b"event: ") and head[7:].decode("utf-8", "replace") in RESPONSES.end_types
