"""RequestRecord: what one request did, filled in along the way and written out once at its end.

A leaf: the middleware creates it, routes and the relay fill it, the access log and metrics read it.
`EngineErrorKind` names how an exchange with the engine failed (the access log's `engine_error=` and
the `kind` label of `nemotron_gateway_engine_errors_total`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol


class EngineErrorKind(StrEnum):
    """How an exchange with the engine failed."""

    REFUSED = "refused"  # connection refused: nothing listens, the engine never saw the request
    CONNECTION_LOST = "connection_lost"  # the connection dropped before the answer started
    TIMEOUT = "timeout"  # no answer (or a silent stream) within the relay's timeout
    PROTOCOL = "protocol"  # an answer that is not valid HTTP/OpenAI
    ERROR_STATUS = "error_status"  # the engine answered non-2xx (relayed to the client as it is)
    MID_STREAM = "mid_stream"  # a started stream broke or ended unfinished
    FROZEN = "frozen"  # the engine monitor found the engine not generating and ended the request

    @property
    def engine_worked(self) -> bool:
        """Whether the engine may have generated tokens: if so an unknown usage keeps the token charge.

        A refused connection never reached the engine, and an error answer is given before generating.
        """
        return self not in (EngineErrorKind.REFUSED, EngineErrorKind.ERROR_STATUS)


class RequestTrace(Protocol):
    """The request's trace where tracing is on (gateway/tracing/): told what the engine answers, ended once."""

    @property
    def trace_id(self) -> int:
        """The trace's id (the access log shows it)."""
        ...

    @property
    def recording(self) -> bool:
        """Whether the request is sampled: its spans are built and exported."""
        ...

    @property
    def marks(self) -> tuple[bytes, ...]:
        """What makes the stream relay parse a chunk for `read` as well (recording only)."""
        ...

    def read(self, event: dict[str, Any]) -> None:
        """An answer or stream event of the engine (its finish reasons, id, the text when captured)."""
        ...

    def end(self, record: RequestRecord, status: int, ended_at: float) -> None:
        """The request is over (its last byte sent at `ended_at`): build and hand over its spans."""
        ...


@dataclass(slots=True)
class RequestRecord:
    """One request's facts for the access-log line and the metrics; never holds a secret."""

    request_id: str
    started_at: float
    key_name: str | None = None
    model: str | None = None
    stream: bool = False
    first_chunk_at: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    # When the client was found gone (`client_disconnected`), on the clock of `started_at`.
    client_gone_at: float | None = None
    engine_error: EngineErrorKind | None = None
    # A refusal's cause class (GatewayError.cause: the limit of a 429, the class of a 401), for metrics and logs.
    cause: str | None = None
    reasoning_tokens: int | None = None
    # The id the engine saw: the client's id plus a random suffix, so two clients sending the same
    # X-Request-ID never collide inside the engine (the client still gets its own id back).
    engine_request_id: str | None = None
    # The API the route serves (chat, completions, responses, messages) and its route label (a path template).
    api: str | None = None
    route: str | None = None
    # The id of a Responses API answer (`resp_...`), for the stored-response ownership.
    response_id: str | None = None
    # A stored response read back or cancelled: the usage it reports is its making's, counted then, so never taken.
    replay: bool = False
    # Whether the gateway stores this exchange's Responses answer: then `response` holds its finished object.
    keep_response: bool = False
    response: dict[str, Any] | None = None
    # The key's priority as admitted (lower is sooner).
    priority: int | None = None
    # The replica that answered (its URL), and how it was picked (affinity, spill, least_loaded, failover, ...).
    replica: str | None = None
    routed: str | None = None
    # Marks on the clock of `started_at`, for the request's trace: the key checked, the body read and prepared, the
    # engine connection in hand, its answer's head read, the exchange settled (the answer's last byte, or its end).
    key_checked_at: float | None = None
    prepared_at: float | None = None
    engine_connected_at: float | None = None
    engine_answered_at: float | None = None
    engine_ended_at: float | None = None
    trace: RequestTrace | None = None

    @property
    def client_disconnected(self) -> bool:
        """Whether the client went away before its answer was complete."""
        return self.client_gone_at is not None

    @client_disconnected.setter
    def client_disconnected(self, gone: bool) -> None:
        if not gone:
            self.client_gone_at = None
        elif self.client_gone_at is None:
            self.client_gone_at = time.perf_counter()

    def take_usage(self, usage: Any) -> None:
        """Record the engine's `usage` object (ignored when malformed): OpenAI's chat and completion names
        (`prompt_tokens`, `completion_tokens`), the Responses API's (`input_tokens`, `output_tokens`, with
        `output_tokens_details.reasoning_tokens`) or Anthropic's (`input_tokens` less the cache's counts)."""
        if not isinstance(usage, dict):
            return
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        details = usage.get("completion_tokens_details")
        if prompt is None and completion is None:
            prompt, completion = usage.get("input_tokens"), usage.get("output_tokens")
            details = usage.get("output_tokens_details")
            if isinstance(prompt, int):
                # Anthropic counts cached prompt tokens apart; the prompt is their sum.
                prompt += sum(
                    count
                    for count in (usage.get("cache_read_input_tokens"), usage.get("cache_creation_input_tokens"))
                    if isinstance(count, int)
                )
        if isinstance(prompt, int) and isinstance(completion, int):
            self.prompt_tokens, self.completion_tokens = prompt, completion
        if isinstance(details, dict) and isinstance(details.get("reasoning_tokens"), int):
            self.reasoning_tokens = details["reasoning_tokens"]

    def take_answer(self, answer: dict[str, Any]) -> None:
        """Record what an engine answer or stream event says about the exchange: its usage (top level, or in a
        Responses event's `response`) and a Responses answer's id; nothing for a `replay`."""
        if self.replay:
            return
        response = answer.get("response")
        inner = response if isinstance(response, dict) else answer
        if inner.get("object") == "response" and isinstance(inner.get("id"), str):
            self.response_id = inner["id"]
            if self.keep_response:
                self.response = inner
        self.take_usage(answer.get("usage") if "usage" in answer else inner.get("usage"))

    @property
    def total_tokens(self) -> int | None:
        """Prompt plus completion tokens, when the engine reported them."""
        if self.prompt_tokens is None or self.completion_tokens is None:
            return None
        return self.prompt_tokens + self.completion_tokens
