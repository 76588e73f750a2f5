"""The wire shapes of the APIs the gateway relays: how each one's stream ends and how its errors look.

Chat and text completions end a stream with `data: [DONE]` and carry errors in OpenAI's envelope; the
Responses API ends with a terminal `response.*` event and reports a failure as an `event: error`; the
Anthropic Messages API ends with `message_stop` and speaks Anthropic's error envelope, the engine's error answers
included. A route declares its shape (gateway/api/table.py); the relay and the dispatcher read it. Imports errors
only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.errors import GatewayError, anthropic_error_type

_DONE = b"data: [DONE]"
_DONE_MARK = b"[DONE]"
_RESPONSES_ENDS = frozenset(("response.completed", "response.incomplete", "response.failed", "error"))


def _openai_event(error: GatewayError) -> bytes:
    # The OpenAI SDK raises APIError on any event whose data carries an `error` object.
    return b"data: " + error.to_json() + b"\n\n"


def _responses_event(error: GatewayError) -> bytes:
    # The Responses stream's own error event (`type: error` with code, message, param), with OpenAI's envelope
    # under `error` as well: the OpenAI SDK raises APIError on that object, a typed reader sees its event.
    envelope = error.to_openai_body()["error"]
    event = {"type": "error", "code": error.code, "message": error.message, "param": error.param, "error": envelope}
    return b"event: error\ndata: " + orjson.dumps(event) + b"\n\n"


def _anthropic_event(error: GatewayError) -> bytes:
    # The Anthropic SDK raises its APIStatusError on `event: error`.
    return b"event: error\ndata: " + error.to_anthropic_json() + b"\n\n"


def _chat_answer(event: dict[str, Any]) -> dict[str, Any] | None:
    # The usage chunk (stream_options.include_usage) carries the exchange's usage at its top level; the client's
    # text only ever reaches a chunk inside a JSON string, so it can plant no top-level key.
    return event if isinstance(event.get("usage"), dict) else None


def _responses_answer(event: dict[str, Any]) -> dict[str, Any] | None:
    # Only the terminal event's response is the finished one; the first events echo the request's `metadata` and
    # `tools`, whatever they hold.
    response = event.get("response")
    return response if event.get("type") in _RESPONSES_ENDS and isinstance(response, dict) else None


def _messages_answer(event: dict[str, Any]) -> dict[str, Any] | None:
    # `message_delta` carries the whole usage (prompt and output tokens); `message_start`'s holds the prompt only, so
    # a stream cut after it keeps the up-front charge rather than charging the prompt alone.
    return event if event.get("type") == "message_delta" and isinstance(event.get("usage"), dict) else None


def _parsed(body: bytes) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return None


def _engine_message(status: int, body: bytes, parsed: Any) -> str:
    """What the engine said: the message of its envelope (OpenAI's or Anthropic's, both `error.message`), its bare
    `error` or FastAPI `detail` string, else its text."""
    if isinstance(parsed, dict):
        error = parsed.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
        for said in (error, parsed.get("detail")):
            if isinstance(said, str) and said:
                return f"The model engine answered HTTP {status}: {said[:300]}"
    detail = body.decode("utf-8", "replace").strip()[:300] or "no details"
    return f"The model engine answered HTTP {status}: {detail}"


def engine_message(status: int, body: bytes) -> str:
    """What the engine said in an error answer of `status` (whatever its envelope), as one message."""
    return _engine_message(status, body, _parsed(body))


def _engine_openai_body(status: int, body: bytes) -> bytes:
    """The engine's error answer in OpenAI's envelope: kept when it already is one (not Anthropic's, which has a
    top-level `type`), else wrapped."""
    parsed = _parsed(body)
    if isinstance(parsed, dict) and "type" not in parsed and isinstance(parsed.get("error"), dict):
        if "message" in parsed["error"]:
            return body
    message = _engine_message(status, body, parsed)
    return orjson.dumps({"error": {"message": message, "type": "engine_error", "param": None, "code": status}})


def _engine_anthropic_body(status: int, body: bytes) -> bytes:
    """The engine's error answer in Anthropic's envelope, its `type` Anthropic's for the status: vLLM's own
    Anthropic answers name a Python exception there, and its request validation answers OpenAI's envelope on every
    path, /v1/messages included."""
    message = _engine_message(status, body, _parsed(body))
    return orjson.dumps({"type": "error", "error": {"type": anthropic_error_type(status), "message": message}})


@dataclass(frozen=True, slots=True)
class WireShape:
    """What differs between the relayed APIs on the wire; `api` names the API in metrics and the access log.

    The end of a stream and its usage are read from the engine's own structure, never from a substring of a chunk:
    a chunk echoes client text (the Responses API repeats the request's `metadata` and `tools` in its first events),
    and a client who could end its stream early would end its accounting with it (its concurrency slot freed, its
    tokens charged at the estimate). A chunk holding one of `end_marks` (or a usage object) is a candidate: its
    `data:` lines are parsed, and their top-level `type` decides.
    """

    api: str
    # The top-level `type`s of the events that end the stream; empty: it ends with a `data: [DONE]` line.
    end_types: frozenset[str]
    # The object of an event that reports on the exchange (its usage, a response's id), or None.
    answer_of: Callable[[dict[str, Any]], dict[str, Any] | None]
    error_event: Callable[[GatewayError], bytes]
    error_body: Callable[[GatewayError], bytes]
    # Whether the gateway added a usage-only chunk the client did not ask for (chat's `stream_options`).
    strips_usage: bool = False
    # The engine's error answer (its status and body, whatever their envelope) in this API's envelope.
    engine_error_body: Callable[[int, bytes], bytes] = _engine_openai_body

    @property
    def end_marks(self) -> tuple[bytes, ...]:
        """What a chunk holding the end of the stream contains: `[DONE]`, or an end type as vLLM's compact JSON
        writes it. A chunk without any of these cannot end the stream (one with them may not: it is parsed)."""
        if not self.end_types:
            return (_DONE_MARK,)
        return tuple(b'"type":"%s"' % kind.encode() for kind in sorted(self.end_types))

    def ends(self, line: bytes, event: dict[str, Any] | None) -> bool:
        """Whether the `data:` `line` (parsed: `event`, None when it is not a JSON object) ends the stream."""
        if not self.end_types:
            return line.rstrip() == _DONE
        return event is not None and event.get("type") in self.end_types


def _openai_body(error: GatewayError) -> bytes:
    return error.to_json()


def _anthropic_body(error: GatewayError) -> bytes:
    return error.to_anthropic_json()


_NO_ENDS: frozenset[str] = frozenset()
CHAT = WireShape("chat", _NO_ENDS, _chat_answer, _openai_event, _openai_body, strips_usage=True)
COMPLETIONS = WireShape("completions", _NO_ENDS, _chat_answer, _openai_event, _openai_body, strips_usage=True)
# vLLM ends these streams with their terminal event and no `[DONE]` (its JSON is compact: no spaces).
RESPONSES = WireShape("responses", _RESPONSES_ENDS, _responses_answer, _responses_event, _openai_body)
MESSAGES = WireShape(
    "messages",
    frozenset(("message_stop", "error")),
    _messages_answer,
    _anthropic_event,
    _anthropic_body,
    engine_error_body=_engine_anthropic_body,
)
