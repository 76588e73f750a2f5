"""A fake `vllm serve`: vLLM's OpenAI-compatible HTTP API with per-request faults and a request log.

Speaks chat and text completions, the Responses API (its `event:` stream; without a response store, as the
gateway runs vLLM: a `previous_response_id` is unknown, a `background` request refused) and Anthropic's Messages API
(`message_start` ... `message_stop`), in vLLM's shapes.

Pure ASGI under uvicorn, so it owns `receive()` and can see a client leave at any point.
Run it as `python -m tests.fakes.fake_engine --port P`; it imports nothing from `gateway`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from http import HTTPStatus
from types import FrameType
from typing import Any

import uvicorn
from starlette.types import Receive, Scope, Send

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "nemotron-test"
DEFAULT_MAX_MODEL_LEN = 4096
DEFAULT_OUTPUT_TOKENS = 16
SSE_CONTENT_TYPE = b"text/event-stream; charset=utf-8"
JSON_CONTENT_TYPE = b"application/json"
# The request-id prefix of the gateway's generation probes (gateway.relay.client.PROBE_ID_PREFIX).
GATEWAY_PROBE_PREFIX = "probe-"
# vLLM names its error types after the exception it raised; these are the ones it uses.
_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError"}


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def error_body(status: int, message: str) -> dict[str, Any]:
    """vLLM's error envelope for `status`."""
    default = HTTPStatus(status).phrase.replace(" ", "").replace("-", "") + "Error"
    err_type = _ERROR_TYPES.get(status, default)
    return {"error": {"message": message, "type": err_type, "param": None, "code": status}}


@dataclass
class RequestRecord:
    """What a test can assert on about one completion request; served as JSON by /_test/requests."""

    seq: int
    method: str
    path: str
    headers: dict[str, str]
    body: Any
    request_id: str | None
    stream: bool
    received_at: float
    status: int | None = None
    tokens_sent: int = 0
    completed: bool = False
    completed_at: float | None = None
    disconnected: bool = False
    disconnected_at: float | None = None
    aborted: bool = False


@dataclass
class Faults:
    """The `fake_*` body fields that steer one request."""

    token_delay: float = 0.0
    prefill_delay: float = 0.0
    status: int | None = None
    message: str = "fake_status"  # the error answer's message, with `status`
    die_after: int | None = None
    hang: bool = False

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> Faults:
        status, die_after = body.get("fake_status"), body.get("fake_die_after")
        return cls(
            token_delay=float(body.get("fake_token_delay", 0.0)),
            prefill_delay=float(body.get("fake_prefill_delay", 0.0)),
            status=int(status) if status is not None else None,
            message=str(body.get("fake_message", "fake_status")),
            die_after=int(die_after) if die_after is not None else None,
            hang=bool(body.get("fake_hang", False)),
        )


@dataclass
class Stats:
    requests: int = 0
    active_requests: int = 0
    active_streams: int = 0
    completed: int = 0
    disconnects: int = 0
    aborted: int = 0
    health_checks: int = 0
    generation_probes: int = 0  # a gateway's one-token liveness probes (not in the request log)
    metrics_scrapes: int = 0
    peak_waiting: int = 0  # most client requests ever waiting for a slot at once (with --max-num-seqs)


@dataclass
class Health:
    status: int = 200
    hang: bool = False
    delay: float = 0.0  # seconds before /health and /metrics answer: an API server saturated by load


class Exchange:
    """One HTTP exchange: reads the body, then watches `receive()` for the client going away."""

    def __init__(self, receive: Receive, send: Send) -> None:
        self._receive = receive
        self.send = send
        self.gone = asyncio.Event()
        self._watcher: asyncio.Task[None] | None = None

    async def read_body(self) -> bytes | None:
        chunks: list[bytes] = []
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                return None
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        self._watcher = asyncio.create_task(self._watch())
        return b"".join(chunks)

    async def _watch(self) -> None:
        # After the body, uvicorn's receive() only returns on disconnect or once the response is complete.
        while (await self._receive())["type"] != "http.disconnect":
            pass
        self.gone.set()

    async def pause(self, seconds: float) -> bool:
        """Sleep up to `seconds` (at least one loop turn); True if the client went away meanwhile."""
        if seconds <= 0:
            await asyncio.sleep(0)
            return self.gone.is_set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.gone.wait(), seconds)
        return self.gone.is_set()

    async def start(self, status: int, content_type: bytes | None, length: int | None = None) -> None:
        headers = [] if content_type is None else [(b"content-type", content_type)]
        if length is not None:
            headers.append((b"content-length", str(length).encode()))
        await self.send({"type": "http.response.start", "status": status, "headers": headers})

    async def send_body(self, body: bytes, more: bool = False) -> None:
        await self.send({"type": "http.response.body", "body": body, "more_body": more})

    async def send_json(self, status: int, obj: Any) -> None:
        body = _dumps(obj)
        await self.start(status, JSON_CONTENT_TYPE, len(body))
        await self.send_body(body)

    async def send_empty(self, status: int) -> None:
        await self.start(status, None, 0)
        await self.send_body(b"")

    async def abort(self) -> None:
        """Close the TCP connection mid-response, like an engine process dying."""
        # uvicorn hands out its per-request cycle's bound `send`; its transport is the only way to
        # drop a connection before any response (returning early would make uvicorn answer 500).
        transport = getattr(getattr(self.send, "__self__", None), "transport", None)
        if transport is None:
            return  # returning without completing makes uvicorn close the transport itself
        transport.close()
        # Waiting for connection_lost keeps uvicorn from logging "returned without completing response".
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.gone.wait(), 1.0)

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher


def _api_of(path: str) -> str:
    for api in ("chat/completions", "completions", "responses", "messages/count_tokens", "messages"):
        if path.endswith("/" + api):
            return api.split("/")[0] if api != "messages/count_tokens" else "count_tokens"
    return "completions"


def count_prompt_tokens(path: str, body: dict[str, Any]) -> int:
    """A deterministic prompt size: whitespace words of the text, or the length of token-id lists."""
    api = _api_of(path)
    if api == "responses":
        source = body.get("input")
        items = [{"content": source}] if isinstance(source, str) else source or []
        items = [*items, {"content": body.get("instructions")}]
        return count_prompt_tokens("/v1/chat/completions", {"messages": items})
    if api in ("messages", "count_tokens"):
        return count_prompt_tokens(
            "/v1/chat/completions", {"messages": [*(body.get("messages") or []), {"content": body.get("system")}]}
        )
    if api == "chat":
        texts: list[Any] = []
        for message in body.get("messages") or []:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list):
                texts.extend(part.get("text", "") for part in content if isinstance(part, dict))
            else:
                texts.append(content)
        return sum(len(str(text).split()) for text in texts if text)
    prompt = body.get("prompt", "")
    items = prompt if isinstance(prompt, list) else [prompt]
    if items and all(isinstance(item, int) for item in items):
        return len(items)
    return sum(len(item) if isinstance(item, list) else len(str(item).split()) for item in items)


@dataclass
class Completion:
    """The answer to one completion request, rendered in vLLM's chat or text-completion shapes."""

    chat: bool
    model: str
    prompt_tokens: int
    max_tokens: int | None
    include_usage: bool
    # chat, completions, responses or messages: the shape of the answer.
    api: str = "completions"
    # Where the answer ends on its own (the model's end of text) when `max_tokens` does not cut it first; None: it
    # runs to `max_tokens`.
    eos_after: int | None = None
    # What vLLM repeats of a Responses API request in its response objects (`metadata`, `tools`).
    echo: dict[str, Any] = field(default_factory=dict)
    # A Responses answer that calls a tool (`fake_function_call`: its `name` and `arguments`): its output is that
    # function_call item instead of a message (a stream's deltas stay text: only the response objects carry it).
    function_call: dict[str, Any] | None = None
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def n_tokens(self) -> int:
        if self.max_tokens is None:
            return DEFAULT_OUTPUT_TOKENS if self.eos_after is None else self.eos_after
        return self.max_tokens if self.eos_after is None else min(self.max_tokens, self.eos_after)

    @property
    def finish_reason(self) -> str:
        return "length" if self.max_tokens is not None and self.n_tokens == self.max_tokens else "stop"

    def usage(self, completion_tokens: int) -> dict[str, int]:
        total = self.prompt_tokens + completion_tokens
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": total}

    def _envelope(self, stream: bool) -> dict[str, Any]:
        prefix, obj = ("chatcmpl-", "chat.completion") if self.chat else ("cmpl-", "text_completion")
        if self.chat and stream:
            obj += ".chunk"
        return {"id": prefix + self.id, "object": obj, "created": self.created, "model": self.model}

    def response(self) -> dict[str, Any]:
        if self.api == "responses":
            return self.responses_object("completed", self.n_tokens)
        if self.api == "messages":
            text = " ".join(f"tok{i}" for i in range(self.n_tokens))
            return {
                "id": f"msg_{self.id}",
                "type": "message",
                "role": "assistant",
                "model": self.model,
                "content": [{"type": "text", "text": text}],
                "stop_reason": "end_turn" if self.finish_reason == "stop" else "max_tokens",
                "stop_sequence": None,
                "usage": {"input_tokens": self.prompt_tokens, "output_tokens": self.n_tokens},
            }
        text = " ".join(f"tok{i}" for i in range(self.n_tokens))
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text, "tool_calls": []}
        else:
            choice["text"] = text
        choice.update(logprobs=None, finish_reason=self.finish_reason, stop_reason=None)
        return {**self._envelope(False), "choices": [choice], "usage": self.usage(self.n_tokens)}

    def _chunk(self, delta: str, finish_reason: str | None, role: bool = False) -> bytes:
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["delta"] = {"role": "assistant", "content": delta} if role else {"content": delta}
        else:
            choice["text"] = delta
        choice.update(logprobs=None, finish_reason=finish_reason)
        if not self.chat:
            choice["stop_reason"] = None
        chunk = {**self._envelope(True), "choices": [choice]}
        if self.include_usage:
            chunk["usage"] = None
        return b"data: " + _dumps(chunk) + b"\n\n"

    def responses_usage(self, output_tokens: int) -> dict[str, Any]:
        """The Responses API's usage; half the output tokens are reasoning tokens here."""
        return {
            "input_tokens": self.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": output_tokens // 2},
            "total_tokens": self.prompt_tokens + output_tokens,
        }

    def responses_object(self, status: str, output_tokens: int | None) -> dict[str, Any]:
        """A Responses API `response` object (in_progress: no output, no usage)."""
        text = " ".join(f"tok{i}" for i in range(output_tokens or 0))
        output: list[dict[str, Any]] = []
        if output_tokens is not None and self.function_call is not None:
            call = {"name": str(self.function_call.get("name")), "arguments": str(self.function_call.get("arguments"))}
            output.append(
                {"type": "function_call", "id": f"fc_{self.id}", "call_id": f"call_{self.id}", **call, "status": status}
            )
        elif output_tokens is not None:
            content = [{"type": "output_text", "text": text, "annotations": []}]
            output.append(
                {"type": "message", "id": f"msg_{self.id}", "role": "assistant", "status": status, "content": content}
            )
        return {
            "id": f"resp_{self.id}",
            "object": "response",
            "created_at": self.created,
            "model": self.model,
            "status": status,
            "output": output,
            "usage": None if output_tokens is None else self.responses_usage(output_tokens),
            **self.echo,
        }

    def _typed(self, kind: str, obj: dict[str, Any]) -> bytes:
        return f"event: {kind}\ndata: ".encode() + _dumps({"type": kind, **obj}) + b"\n\n"

    def events(self) -> Iterator[tuple[str, bytes]]:
        """(kind, SSE event) in order: [role], one `token` per token, [usage], `done`."""
        if self.api == "responses":
            yield (
                "role",
                self._typed(
                    "response.created", {"sequence_number": 0, "response": self.responses_object("in_progress", None)}
                ),
            )
            for i in range(self.n_tokens):
                delta = {"sequence_number": i + 1, "item_id": f"msg_{self.id}", "output_index": 0, "content_index": 0}
                yield (
                    "token",
                    self._typed("response.output_text.delta", {**delta, "delta": f"tok{i}" if i == 0 else f" tok{i}"}),
                )
            final = {
                "sequence_number": self.n_tokens + 1,
                "response": self.responses_object("completed", self.n_tokens),
            }
            yield "done", self._typed("response.completed", final)
            return
        if self.api == "messages":
            start = {"message": {**self.response(), "content": [], "stop_reason": None}}
            start["message"]["usage"] = {"input_tokens": self.prompt_tokens, "output_tokens": 0}
            yield "role", self._typed("message_start", start)
            yield (
                "block",
                self._typed("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
            )
            for i in range(self.n_tokens):
                delta = {"type": "text_delta", "text": f"tok{i}" if i == 0 else f" tok{i}"}
                yield "token", self._typed("content_block_delta", {"index": 0, "delta": delta})
            yield "block", self._typed("content_block_stop", {"index": 0})
            usage = {"input_tokens": self.prompt_tokens, "output_tokens": self.n_tokens}
            stop = {"stop_reason": "end_turn" if self.finish_reason == "stop" else "max_tokens", "stop_sequence": None}
            yield "usage", self._typed("message_delta", {"delta": stop, "usage": usage})
            yield "done", self._typed("message_stop", {})
            return
        if self.chat:
            yield "role", self._chunk("", None, role=True)
        for i in range(self.n_tokens):
            last = i == self.n_tokens - 1
            yield "token", self._chunk(f"tok{i}" if i == 0 else f" tok{i}", self.finish_reason if last else None)
        if self.n_tokens == 0:
            yield "finish", self._chunk("", self.finish_reason)
        if self.include_usage:
            usage_chunk = {**self._envelope(True), "choices": [], "usage": self.usage(self.n_tokens)}
            yield "usage", b"data: " + _dumps(usage_chunk) + b"\n\n"
        yield "done", b"data: [DONE]\n\n"


_GENERATING = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")


def _max_tokens(body: dict[str, Any]) -> int | None:
    """The completion length a request asks for, in whichever of the APIs' fields it uses."""
    for name in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
        if body.get(name) is not None:
            return int(body[name])
    return None


class FakeEngine:
    """The ASGI app: OpenAI routes, health, and the /_test/* control and inspection endpoints."""

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        max_model_len: int = DEFAULT_MAX_MODEL_LEN,
        api_key: str | None = None,
        scheduling_policy: str = "fcfs",
        max_num_seqs: int | None = None,
    ) -> None:
        self.model = model
        # As vLLM 0.26 under FCFS: a non-zero `priority` is refused (400), under "priority" it is taken.
        self.scheduling_policy = scheduling_policy
        # What /metrics reports as waiting requests and KV-cache use when a test sets them (/_test/load).
        self.reported_waiting: float | None = None
        self.reported_kv_cache: float | None = None
        # As vLLM's --max-num-seqs: requests beyond it wait (and /metrics says so) until a running one ends.
        self.max_num_seqs = max_num_seqs
        self._slots: asyncio.Semaphore | None = None
        self.waiting = 0
        self._waiting_clients = 0
        # As vLLM with VLLM_API_KEY: its /v1 routes want `Authorization: Bearer <key>`, the others do not.
        self.authorization = f"Bearer {api_key}".encode() if api_key else None
        self.max_model_len = max_model_len
        self.created = int(time.time())
        self.records: list[RequestRecord] = []
        self.by_request_id: dict[str, RequestRecord] = {}
        self.stats = Stats()
        self.health = Health()
        # vLLM's /metrics: tokens generated so far. Generation proceeds while `unfrozen` is set (a frozen
        # EngineCore: /health still 200, no token); `api_frozen` also hangs /metrics (a stopped API server).
        self.generated_tokens = 0
        # vLLM's prefix-cache counters, in prompt tokens (`_count_prefix_cache`), and the prefixes it holds.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self._cached_prefixes: set[str] = set()
        self.unfrozen = asyncio.Event()
        self.unfrozen.set()
        self.api_frozen = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        exchange = Exchange(receive, send)
        try:
            body = await exchange.read_body()
            if body is not None:
                await self._dispatch(scope, exchange, body)
        finally:
            await exchange.close()

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _dispatch(self, scope: Scope, exchange: Exchange, body: bytes) -> None:
        method, path = scope["method"], scope["path"]
        if self.authorization is not None and path.startswith("/v1") and not self._authorized(scope):
            await exchange.send_json(401, {"error": "Unauthorized"})  # vLLM's own answer
        elif method == "POST" and path in _GENERATING:
            await self._completion(scope, exchange, body)
        elif method == "POST" and path == "/v1/messages/count_tokens":
            request = json.loads(body)
            await exchange.send_json(200, {"input_tokens": count_prompt_tokens(path, request)})
        elif method == "GET" and path == "/health":
            await self._health(exchange)
        elif method == "GET" and path == "/metrics":
            await self._metrics(exchange)
        elif method == "GET" and path == "/v1/models":
            await exchange.send_json(200, self._models())
        elif path.startswith("/_test/"):
            await self._control(method, path, exchange, body)
        else:
            await exchange.send_json(404, error_body(404, f"Not Found: {method} {path}"))

    def _authorized(self, scope: Scope) -> bool:
        return any(name == b"authorization" and value == self.authorization for name, value in scope["headers"])

    def _models(self) -> dict[str, Any]:
        permission = {
            "id": f"modelperm-{uuid.uuid4().hex}",
            "object": "model_permission",
            "created": self.created,
            "allow_create_engine": False,
            "allow_sampling": True,
            "allow_logprobs": True,
            "allow_search_indices": False,
            "allow_view": True,
            "allow_fine_tuning": False,
            "organization": "*",
            "group": None,
            "is_blocking": False,
        }
        card = {"id": self.model, "object": "model", "created": self.created, "owned_by": "vllm", "root": self.model}
        card.update(parent=None, max_model_len=self.max_model_len, permission=[permission])
        return {"object": "list", "data": [card]}

    async def _health(self, exchange: Exchange) -> None:
        self.stats.health_checks += 1
        if self.health.hang:
            await exchange.gone.wait()
            return
        if await exchange.pause(self.health.delay):
            return
        await exchange.send_empty(self.health.status)  # vLLM: a bare Response(status_code=...)

    async def _metrics(self, exchange: Exchange) -> None:
        """vLLM's Prometheus names for the two figures the supervisor reads, and the queue, KV-cache and prefix-cache
        figures the shipped dashboard shows (each running request holds an eighth of the cache here)."""
        self.stats.metrics_scrapes += 1
        if self.api_frozen:
            await exchange.gone.wait()
            return
        if await exchange.pause(self.health.delay):
            return
        labels = f'{{engine="0",model_name="{self.model}"}}'
        waiting = float(self.waiting) if self.reported_waiting is None else self.reported_waiting
        kv_cache = self.reported_kv_cache
        if kv_cache is None:
            kv_cache = min(1.0, self.stats.active_requests / 8)
        text = (
            f"vllm:generation_tokens_total{labels} {float(self.generated_tokens)}\n"
            f"vllm:num_requests_running{labels} {float(self.stats.active_requests - self.waiting)}\n"
            f"vllm:num_requests_waiting{labels} {waiting}\n"
            f"vllm:kv_cache_usage_perc{labels} {kv_cache}\n"
            f"vllm:prefix_cache_queries_total{labels} {float(self.prefix_cache_queries)}\n"
            f"vllm:prefix_cache_hits_total{labels} {float(self.prefix_cache_hits)}\n"
            f'vllm:request_success_total{{engine="0",finished_reason="stop",model_name="{self.model}"}} '
            f"{float(self.stats.completed)}\n"
        ).encode()
        await exchange.start(200, b"text/plain; version=0.0.4; charset=utf-8", len(text))
        await exchange.send_body(text)

    async def _frozen(self, exchange: Exchange) -> bool:
        """Wait while generation is frozen; True if the client went away meanwhile."""
        if not self.unfrozen.is_set():
            waits = [asyncio.ensure_future(self.unfrozen.wait()), asyncio.ensure_future(exchange.gone.wait())]
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for wait in waits:
                wait.cancel()
        return exchange.gone.is_set()

    async def _control(self, method: str, path: str, exchange: Exchange, body: bytes) -> None:
        if method == "GET" and path == "/_test/requests":
            await exchange.send_json(200, [asdict(record) for record in self.records])
        elif method == "GET" and path.startswith("/_test/requests/"):
            record = self.by_request_id.get(path.removeprefix("/_test/requests/"))
            if record is None:
                await exchange.send_json(404, error_body(404, "No request with that x-request-id."))
            else:
                await exchange.send_json(200, asdict(record))
        elif method == "GET" and path == "/_test/stats":
            await exchange.send_json(200, asdict(self.stats))
        elif method == "POST" and path == "/_test/reset":
            self.records.clear()
            self.by_request_id.clear()
            active_requests, active_streams = self.stats.active_requests, self.stats.active_streams
            self.stats = Stats(active_requests=active_requests, active_streams=active_streams)
            self.health = Health()
            self.reported_waiting = self.reported_kv_cache = None
            await exchange.send_json(200, {"ok": True})
        elif method == "POST" and path == "/_test/health":
            options = json.loads(body or b"{}")
            self.health = Health(
                status=int(options.get("status", 200)),
                hang=bool(options.get("hang", False)),
                delay=float(options.get("delay", 0.0)),
            )
            await exchange.send_json(200, asdict(self.health))
        elif method == "POST" and path == "/_test/load":
            options = json.loads(body or b"{}")
            self.reported_waiting = options.get("waiting")
            self.reported_kv_cache = options.get("kv_cache")
            await exchange.send_json(200, {"waiting": self.reported_waiting, "kv_cache": self.reported_kv_cache})
        elif method == "POST" and path == "/_test/freeze":
            options = json.loads(body or b"{}")
            frozen = bool(options.get("frozen", True))
            self.api_frozen = frozen and bool(options.get("api", False))
            if frozen:
                self.unfrozen.clear()
            else:
                self.unfrozen.set()
            await exchange.send_json(200, {"frozen": frozen, "api": self.api_frozen})
        elif method == "POST" and path == "/_test/exit":
            code = int(json.loads(body or b"{}").get("code", 1))
            await exchange.send_json(200, {"exiting": code})
            # Let the answer leave before the process vanishes, as a crashing engine would.
            asyncio.get_running_loop().call_later(0.05, os._exit, code)
        else:
            await exchange.send_json(404, error_body(404, f"Not Found: {method} {path}"))

    def _record(self, scope: Scope, body: Any, stream: bool) -> RequestRecord:
        headers: dict[str, str] = {}
        for raw_name, raw_value in scope["headers"]:
            name, value = raw_name.decode("latin-1").lower(), raw_value.decode("latin-1")
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        request_id = headers.get("x-request-id")
        # The gateway's liveness probes would race into every test's request log: counted, not logged.
        probe = request_id is not None and request_id.startswith(GATEWAY_PROBE_PREFIX)
        if probe:
            self.stats.generation_probes += 1
        record = RequestRecord(
            seq=len(self.records) + 1,
            method=scope["method"],
            path=scope["path"],
            headers=headers,
            body=body,
            request_id=request_id,
            stream=stream,
            received_at=time.time(),
        )
        if not probe:
            self.records.append(record)
        if request_id is not None and not probe:
            self.by_request_id[request_id] = record
        return record

    async def _completion(self, scope: Scope, exchange: Exchange, raw: bytes) -> None:
        try:
            body: Any = json.loads(raw)
        except ValueError:
            body = None
        stream = isinstance(body, dict) and bool(body.get("stream", False))
        record = self._record(scope, body, stream)
        self.stats.requests += 1
        self.stats.active_requests += 1
        try:
            if self.max_num_seqs is None:
                await self._answer(exchange, record, body)
            else:
                await self._answer_in_turn(exchange, record, body)
        finally:
            self.stats.active_requests -= 1
            if record.disconnected:
                self.stats.disconnects += 1

    async def _answer_in_turn(self, exchange: Exchange, record: RequestRecord, body: Any) -> None:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_num_seqs or 1)
        # The peak counts client requests only: a gateway's liveness probes are not admitted by it.
        client = not (record.request_id or "").startswith(GATEWAY_PROBE_PREFIX)
        self.waiting += 1
        self._waiting_clients += client
        self.stats.peak_waiting = max(self.stats.peak_waiting, self._waiting_clients)
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
            self._waiting_clients -= client
        try:
            await self._answer(exchange, record, body)
        finally:
            self._slots.release()

    async def _answer(self, exchange: Exchange, record: RequestRecord, body: Any) -> None:
        if not isinstance(body, dict):
            await self._finish_json(exchange, record, 400, error_body(400, "The request body is not a JSON object."))
            return
        faults = Faults.from_body(body)
        if faults.hang:
            await exchange.gone.wait()
            self._mark_gone(record)
            return
        error = self._validate(record.path, body, record.headers)
        if faults.status is not None or error is not None:
            if await exchange.pause(faults.prefill_delay):
                self._mark_gone(record)
            elif faults.status is not None:
                await self._finish_json(exchange, record, faults.status, error_body(faults.status, faults.message))
            elif error is not None:
                await self._finish_json(exchange, record, error[0], error_body(*error))
            return
        asked = _max_tokens(body)
        prompt_tokens = count_prompt_tokens(record.path, body)
        self._count_prefix_cache(record.path, body, prompt_tokens)
        eos_after = body.get("fake_eos_after")
        if eos_after is None and asked is not None and prompt_tokens + asked >= self.max_model_len * 3 // 4:
            # Asked for (nearly) the rest of the context, as a gateway caps a request that left its length to the
            # engine: the answer ends on its own, as a model's does.
            eos_after = DEFAULT_OUTPUT_TOKENS
        completion = Completion(
            api=_api_of(record.path),
            chat=record.path.endswith("/chat/completions"),
            model=self.model,
            prompt_tokens=prompt_tokens,
            # vLLM 0.32 generates at most the rest of the context, whatever more was asked for.
            max_tokens=None if asked is None else min(asked, self.max_model_len - prompt_tokens),
            include_usage=bool((body.get("stream_options") or {}).get("include_usage", False)),
            eos_after=None if eos_after is None else int(eos_after),
            echo={name: body[name] for name in ("metadata", "tools") if name in body},
            function_call=body.get("fake_function_call") if isinstance(body.get("fake_function_call"), dict) else None,
        )
        if record.stream:
            await self._stream(exchange, record, completion, faults)
        else:
            await self._respond(exchange, record, completion, faults)

    def _count_prefix_cache(self, path: str, body: dict[str, Any], prompt_tokens: int) -> None:
        """vLLM's prefix-cache counters for one prompt: every prompt token is queried; a chat prompt's hits are the
        tokens of its longest run of leading messages this engine has seen before (whole messages: vLLM caches
        blocks of tokens, so a turn that repeats an earlier conversation's messages hits about as much)."""
        self.prefix_cache_queries += prompt_tokens
        messages = body.get("messages") if _api_of(path) == "chat" else None
        if not isinstance(messages, list):
            return
        keys = [
            hashlib.sha256(json.dumps(messages[:n], sort_keys=True).encode()).hexdigest()
            for n in range(1, len(messages) + 1)
        ]
        for n in range(len(keys), 0, -1):
            if keys[n - 1] in self._cached_prefixes:
                self.prefix_cache_hits += count_prompt_tokens(path, {"messages": messages[:n]})
                break
        self._cached_prefixes.update(keys)

    def _validate(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[int, str] | None:
        """The checks vLLM makes before generating: model name, priority under FCFS, context length."""
        model = body.get("model")
        if model is not None and model != self.model:
            return 404, f"The model `{model}` does not exist."
        # As vLLM 0.32: the X-Vllm-Priority header first; its Messages API has no `priority` field (dropped).
        priority = int(headers.get("x-vllm-priority") or (0 if path == "/v1/messages" else body.get("priority", 0)))
        if priority != 0 and self.scheduling_policy != "priority":
            return 400, f"Got priority {priority} but Priority scheduling is not enabled."
        if path.endswith("/responses") and body.get("previous_response_id"):
            # vLLM without its store knows no earlier response.
            return 404, f"Response with id '{body['previous_response_id']}' not found."
        if path.endswith("/responses") and body.get("background"):
            return 400, "This vLLM engine does not support `store=True` and therefore does not support background mode."
        if path.endswith("/chat/completions") and not isinstance(body.get("messages"), list):
            return 400, "messages: Field required"
        # As vLLM 0.32: a prompt longer than the context, or a completion length above it, is refused; a completion
        # length past the rest of the context is cut to it.
        prompt_tokens, max_tokens = count_prompt_tokens(path, body), _max_tokens(body)
        if prompt_tokens > self.max_model_len:
            return 400, (
                f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt contains "
                f"{prompt_tokens} input tokens. Please reduce the length of the input prompt."
            )
        if max_tokens is not None and max_tokens > self.max_model_len:
            return 400, f"max_tokens={max_tokens} cannot be greater than max_total_tokens={self.max_model_len}."
        return None

    async def _respond(self, exchange: Exchange, record: RequestRecord, completion: Completion, faults: Faults) -> None:
        if await self._frozen(exchange) or await exchange.pause(
            faults.prefill_delay + faults.token_delay * max(completion.n_tokens - 1, 0)
        ):
            self._mark_gone(record)
        elif faults.die_after is not None:
            await self._abort(exchange, record)
        else:
            record.tokens_sent = completion.n_tokens
            self.generated_tokens += completion.n_tokens
            await self._finish_json(exchange, record, 200, completion.response())

    async def _stream(self, exchange: Exchange, record: RequestRecord, completion: Completion, faults: Faults) -> None:
        self.stats.active_streams += 1
        try:
            record.status = 200
            await exchange.start(200, SSE_CONTENT_TYPE)
            for position, (kind, event) in enumerate(completion.events()):
                if position == 0:
                    delay = faults.prefill_delay
                else:
                    delay = faults.token_delay if kind == "token" and record.tokens_sent > 0 else 0.0
                # vLLM sends even the role chunk only once the engine core produced the first token.
                if await exchange.pause(delay) or (kind in ("role", "token") and await self._frozen(exchange)):
                    self._mark_gone(record)
                    return
                if kind != "role" and faults.die_after is not None and record.tokens_sent >= faults.die_after:
                    await self._abort(exchange, record)
                    return
                await exchange.send_body(event, more=True)
                if kind == "token":
                    record.tokens_sent += 1
                    self.generated_tokens += 1
            await exchange.send_body(b"")
            self._mark_completed(record)
        finally:
            self.stats.active_streams -= 1

    async def _finish_json(self, exchange: Exchange, record: RequestRecord, status: int, obj: Any) -> None:
        record.status = status
        await exchange.send_json(status, obj)
        self._mark_completed(record)

    async def _abort(self, exchange: Exchange, record: RequestRecord) -> None:
        record.aborted = True
        self.stats.aborted += 1
        await exchange.abort()

    def _mark_completed(self, record: RequestRecord) -> None:
        record.completed, record.completed_at = True, time.time()
        self.stats.completed += 1

    def _mark_gone(self, record: RequestRecord) -> None:
        record.disconnected, record.disconnected_at = True, time.time()


class _Server(uvicorn.Server):
    """uvicorn's server, optionally deaf to SIGTERM (an engine stuck in a CUDA call)."""

    def __init__(self, config: uvicorn.Config, ignore_sigterm: bool) -> None:
        super().__init__(config)
        self.ignore_sigterm = ignore_sigterm

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.ignore_sigterm and sig == signal.SIGTERM:
            logger.warning("fake engine ignoring SIGTERM")
            return
        super().handle_exit(sig, frame)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--max-model-len", type=int, default=DEFAULT_MAX_MODEL_LEN)
    parser.add_argument("--startup-delay", type=float, default=0.0, help="seconds before binding (model load)")
    parser.add_argument("--ignore-sigterm", action="store_true")
    parser.add_argument(
        "--spawn-child",
        action="count",
        default=0,
        help="fork a helper holding /dev/shm, like EngineCore (given N times: N helpers, like a worker per GPU)",
    )
    parser.add_argument(
        "--leak-semaphore",
        metavar="PATH",
        help="a short-lived spawned helper creates a multiprocessing semaphore (vLLM's sem.mp-*) and exits "
        "without unlinking it, leaving only the resource tracker knowing its name; its path is written to PATH",
    )
    parser.add_argument("--log-level", default="warning")
    parser.add_argument("--scheduling-policy", default="fcfs", choices=("fcfs", "priority"))
    parser.add_argument("--max-num-seqs", type=int)
    if argv[:1] != ["serve"]:
        return parser.parse_args(argv)
    # `serve --model M --served-model-name N ...`: the shape the supervisor gives `vllm serve`; other vLLM
    # flags are accepted and ignored.
    parser.add_argument("--served-model-name")
    args, _ = parser.parse_known_args(argv[1:])
    args.model = args.served_model_name or args.model
    return args


def _spawn_child() -> None:
    """A helper process in our group that ignores SIGTERM and holds a /dev/shm file (EngineCore's habits)."""
    code = (
        "import os, signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        # vLLM names its processes (setproctitle): the supervisor watches those, not every short-lived helper.
        "open('/proc/self/comm', 'w').write('VLLM::Worker')\n"
        "f = open(f'/dev/shm/fake-engine-{os.getpid()}', 'w')\n"
        "time.sleep(3600)\n"
    )
    subprocess.Popen([sys.executable, "-c", code])


def _semaphore_holder(report: str) -> None:
    """In a spawned child: create a named semaphore, hold it a while (long enough to be seen), vanish."""
    semaphore = multiprocessing.get_context("spawn").Semaphore()
    name = semaphore._semlock.name  # type: ignore[attr-defined]  # "/mp-xxxx", i.e. /dev/shm/sem.mp-xxxx
    time.sleep(2.0)
    with open(report, "w") as handle:
        handle.write(f"/dev/shm/sem.{name.lstrip('/')}")
    # No finalizer runs: the file stays, and only the resource tracker (in our group) knows its name.
    os._exit(0)


def _leak_semaphore(report: str) -> None:
    multiprocessing.get_context("spawn").Process(target=_semaphore_holder, args=(report,), daemon=False).start()


def main(argv: list[str] | None = None) -> None:
    args = _parse(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=args.log_level.upper())
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    for _ in range(args.spawn_child):
        _spawn_child()
    if args.leak_semaphore:
        _leak_semaphore(args.leak_semaphore)
    time.sleep(args.startup_delay)
    app = FakeEngine(
        model=args.model,
        max_model_len=args.max_model_len,
        api_key=os.environ.get("VLLM_API_KEY"),
        scheduling_policy=args.scheduling_policy,
        max_num_seqs=args.max_num_seqs,
    )
    config = uvicorn.Config(
        app, host=args.host, port=args.port, interface="asgi3", log_level=args.log_level, access_log=False
    )
    _Server(config, ignore_sigterm=args.ignore_sigterm).run()


if __name__ == "__main__":
    main()
