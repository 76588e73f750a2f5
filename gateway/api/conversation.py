"""The Responses API's state around one POST /v1/responses: the conversation it continues, and what is kept of it.

The engine is called without a store: a request's `previous_response_id` is answered here, by reading the stored
chain (`responses.ResponseStore.chain`: every link the caller key's, no loop, at most `responses.max_chain` long)
and sending the engine one stateless request whose input is the chain's items (each response's input, then its
output: messages, reasoning, function calls and their outputs, in order) followed by the request's own. With `store`
on (OpenAI's default), the finished response is kept before the client sees its end (for a stream: before its
terminal event goes out), so the next turn finds it, on any gateway and whichever engine serves it. A `background`
request is handed to the background runs (`api/background.py`) once admitted, and answered at once.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from gateway.api.context import get_services
from gateway.api.validation import Models, PreparedRequest, as_input_items, parse_json_object, prepare_responses
from gateway.auth import ApiKey
from gateway.errors import InvalidRequestError, KeyStoreUnavailableError, ResponseNotFoundError
from gateway.request_record import RequestRecord
from gateway.responses import ChainError, ResponseStore
from gateway.settings import Settings

logger = logging.getLogger(__name__)

# Response ids are `resp_` and letters, digits, `_` or `-`; anything else is not one and never reaches Redis.
_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
# The statuses of a background response still being made.
UNFINISHED = ("queued", "in_progress")


def owner_of(key: ApiKey | None) -> str:
    """Who owns what `key` stores: the key's record (`ApiKey.key_id`: kept by a rotation, new for a key created again
    under a deleted one's name); with auth off there is one caller, `-`."""
    return key.key_id if key is not None else "-"


def new_response_id() -> str:
    """A response id of the gateway's own (a background response's), shaped as vLLM's."""
    return "resp_" + os.urandom(16).hex()


def not_found(response_id: str, param: str | None = None) -> ResponseNotFoundError:
    """OpenAI's answer for an id that is unknown, expired, deleted or another key's: they are not told apart."""
    return ResponseNotFoundError(f"No response found with id {response_id[:80]!a}.", param=param)


def checked_id(response_id: str, param: str | None = None) -> str:
    """`response_id` when it can be one (bounded, of id characters), else the not-found error."""
    if not response_id or len(response_id) > 128 or not set(response_id) <= _ID_CHARS:
        raise not_found(response_id, param)
    return response_id


def _history(links: list[tuple[list[dict[str, Any]], dict[str, Any]]]) -> list[dict[str, Any]]:
    """The items the engine reads for a stored chain, oldest first: each response's input, then its output."""
    items: list[dict[str, Any]] = []
    for input_items, response in links:
        items.extend(input_items)
        output = response.get("output")
        if isinstance(output, list):
            items.extend(item for item in output if isinstance(item, dict))
    return items


@dataclass(slots=True)
class Turn:
    """One POST /v1/responses as the gateway keeps it: whose it is, what it continues, whether it is stored and run
    in the background, and its own input items (what `input_items` lists)."""

    store: ResponseStore
    owner: str
    previous_response_id: str | None
    stored: bool
    background: bool
    input_items: list[dict[str, Any]]
    history: list[dict[str, Any]] = field(default_factory=list)

    @property
    def response_fields(self) -> dict[str, Any]:
        """What the client's answer says that the engine, called without its store, cannot."""
        return {"store": self.stored, "previous_response_id": self.previous_response_id}

    def prepare(self, body: bytes, settings: Settings, models: Models) -> PreparedRequest:
        """The request validated, with the conversation it continues before its own input."""
        return prepare_responses(body, settings, models, history=self.history, background=self.background)

    def keeper(self, record: RequestRecord) -> Callable[[], Awaitable[None]] | None:
        """What runs once the exchange is settled (before a stream's end goes out): the finished response stored.
        None when the client asked for `store: false`."""
        if not self.stored:
            return None
        record.keep_response = True

        async def keep() -> None:
            response = record.response
            if response is None:  # a stream that broke or an error answer: nothing finished to keep
                return
            try:
                await self.save(response)
            except KeyStoreUnavailableError:
                if record.stream:
                    # The stream is out already; the response is then only unreadable later (a 404).
                    logger.warning("request %s: its response could not be stored (Redis)", record.request_id)
                    return
                raise

        return keep

    async def save(self, response: dict[str, Any], job: dict[str, Any] | None = None) -> None:
        """Store `response` (with this turn's fields) as the owner's."""
        kept = {**response, **self.response_fields}
        if not await self.store.save(
            self.owner, kept, self.input_items, previous_response_id=self.previous_response_id, job=job
        ):
            logger.warning("response %s is larger than the key's stored bytes and is not kept", kept.get("id"))


async def begin_turn(request: Request, key: ApiKey | None, body: bytes) -> Turn:
    """The stored state of a POST /v1/responses, read before its body is prepared: the chain its
    `previous_response_id` continues (404 when a link is unknown, expired, deleted or another key's; 400 for a
    loop, a chain longer than `responses.max_chain`, or a response not finished yet), whether it is stored
    (`store`, default true) and run in the background (which needs `store`). A 503 when Redis does not answer."""
    services = get_services(request)
    data = parse_json_object(body)
    stored = data.get("store") is not False
    background = data.get("background") is True
    if background and not stored:
        raise InvalidRequestError("A background response is stored: 'background' needs 'store' true.", param="store")
    source = data.get("input")
    # Checked by the preparation that follows: a malformed input is refused there, before anything is stored.
    own = [dict(item) for item in source if isinstance(item, dict)] if isinstance(source, list) else []
    if isinstance(source, str):
        own = as_input_items(source)
    turn = Turn(services.responses, owner_of(key), None, stored, background, own)
    previous = data.get("previous_response_id")
    if previous is None:
        return turn
    if not isinstance(previous, str):
        raise InvalidRequestError("'previous_response_id' must be a string.", param="previous_response_id")
    turn.previous_response_id = checked_id(previous, "previous_response_id")
    try:
        links = await services.responses.chain(previous, turn.owner)
    except ChainError as broken:
        if broken.reason == "missing":
            raise not_found(broken.response_id, "previous_response_id") from None
        if broken.reason == "cycle":
            message = (
                f"The chain of 'previous_response_id' loops at {broken.response_id[:80]!a}; it cannot be continued."
            )
        else:
            message = (
                f"The conversation before {previous[:80]!a} holds more than {services.settings.responses.max_chain} "
                "responses; send the conversation in 'input' instead."
            )
        raise InvalidRequestError(message, param="previous_response_id") from None
    status = links[-1][1].get("status")
    if status in UNFINISHED:
        raise InvalidRequestError(
            f"Response {previous[:80]!a} is {status}; continue it once it is finished.", param="previous_response_id"
        )
    turn.history = _history(links)
    return turn


def queued_response(
    response_id: str, turn: Turn, prepared: PreparedRequest, created_at: int | None = None
) -> dict[str, Any]:
    """The response object of a background request as created: queued, nothing generated yet."""
    data = parse_json_object(prepared.body)
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at if created_at is not None else int(time.time()),
        "status": "queued",
        "background": True,
        "model": prepared.model,
        "instructions": data.get("instructions"),
        "max_output_tokens": data.get("max_output_tokens"),
        "metadata": data.get("metadata") or {},
        "output": [],
        "parallel_tool_calls": data.get("parallel_tool_calls", True),
        "temperature": data.get("temperature"),
        "tool_choice": data.get("tool_choice", "auto"),
        "tools": data.get("tools") or [],
        "top_p": data.get("top_p"),
        "error": None,
        "incomplete_details": None,
        "usage": None,
        **turn.response_fields,
    }
