"""A minimal-CPU OpenAI-compatible engine for benchmarks: canned bytes over raw asyncio (uvloop) HTTP/1.1.

No framework, no JSON parsing: the request is found with byte searches, every answer is pre-encoded.
It must cost far less CPU than the gateway so its core is never the bottleneck. Imports nothing of ours.

    python -m loadtest.stub_engine --port P [--chunks N] [--chunk-delay S] [--prefill-delay S]

A stream has `max_tokens` content chunks when the body carries `"max_tokens":<n>` (or the chat API's
`"max_completion_tokens":<n>`, which vLLM's benchmark client sends), else `--chunks`.
`--prefill-delay` holds the first content chunk (and a non-streamed answer) back, like a prompt's prefill;
later chunks follow `--chunk-delay` apart, so a load generator's TTFT and inter-token latency are known.
Request bodies need a Content-Length (no chunked uploads); pipelined requests are answered in order.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from collections.abc import Sequence
from typing import cast

import orjson
import uvloop

MODEL = "bench-model"
MAX_MODEL_LEN = 4096
CREATED = 1_700_000_000
PROMPT_TOKENS = 24
_MAX_CHUNKS = 100_000
_MAX_HEAD = 64 * 1024


def _dumps(obj: object) -> bytes:
    return orjson.dumps(obj)


def _response(status: bytes, body: bytes) -> bytes:
    return b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (status, len(body), body)


def _frame(event: bytes) -> bytes:
    """One SSE event as one chunk of chunked transfer encoding."""
    data = b"data: " + event + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(data), data)


def _usage(completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": PROMPT_TOKENS,
        "total_tokens": PROMPT_TOKENS + completion_tokens,
        "completion_tokens": completion_tokens,
    }


class _Canned:
    """Every byte string the engine sends, encoded once at start-up."""

    def __init__(self) -> None:
        self.health = _response(b"200 OK", b"")
        self.models = _response(
            b"200 OK",
            _dumps(
                {
                    "object": "list",
                    "data": [
                        {
                            "id": MODEL,
                            "object": "model",
                            "created": CREATED,
                            "owned_by": "vllm",
                            "root": MODEL,
                            "parent": None,
                            "max_model_len": MAX_MODEL_LEN,
                        }
                    ],
                }
            ),
        )
        self.not_found = _response(b"404 Not Found", b'{"error":{"message":"not found","type":"NotFoundError"}}')
        self.stream_head = (
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        self.done = _frame(b"[DONE]") + b"0\r\n\r\n"
        self.chat = _response(b"200 OK", _dumps(self._chat_completion()))
        self.completion = _response(b"200 OK", _dumps(self._text_completion()))
        chat_id = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": CREATED, "model": MODEL}
        text_id = {"id": "cmpl-bench", "object": "text_completion", "created": CREATED, "model": MODEL}
        chat_choice: dict[str, object] = {"index": 0, "delta": {"content": " token"}, "logprobs": None}
        text_choice: dict[str, object] = {"index": 0, "text": " token", "logprobs": None, "stop_reason": None}
        self.chat_chunk = _frame(_dumps({**chat_id, "choices": [{**chat_choice, "finish_reason": None}]}))
        self.chat_last = _frame(_dumps({**chat_id, "choices": [{**chat_choice, "finish_reason": "length"}]}))
        self.text_chunk = _frame(_dumps({**text_id, "choices": [{**text_choice, "finish_reason": None}]}))
        self.text_last = _frame(_dumps({**text_id, "choices": [{**text_choice, "finish_reason": "length"}]}))
        self._chat_id, self._text_id = chat_id, text_id
        self._usage_frames: dict[tuple[bool, int], bytes] = {}

    def usage_frame(self, chat: bool, completion_tokens: int) -> bytes:
        """The final usage-only chunk (`"choices":[]`), cached per token count."""
        key = (chat, completion_tokens)
        frame = self._usage_frames.get(key)
        if frame is None:
            ident = self._chat_id if chat else self._text_id
            frame = _frame(_dumps({**ident, "choices": [], "usage": _usage(completion_tokens)}))
            if len(self._usage_frames) < 1024:
                self._usage_frames[key] = frame
        return frame

    @staticmethod
    def _chat_completion() -> dict[str, object]:
        return {
            "id": "chatcmpl-bench",
            "object": "chat.completion",
            "created": CREATED,
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": " token" * 16, "tool_calls": []},
                    "logprobs": None,
                    "finish_reason": "length",
                    "stop_reason": None,
                }
            ],
            "usage": _usage(16),
            "prompt_logprobs": None,
        }

    @staticmethod
    def _text_completion() -> dict[str, object]:
        return {
            "id": "cmpl-bench",
            "object": "text_completion",
            "created": CREATED,
            "model": MODEL,
            "choices": [
                {"index": 0, "text": " token" * 16, "logprobs": None, "finish_reason": "length", "stop_reason": None}
            ],
            "usage": _usage(16),
        }


def _int_after(body: bytes, marker: bytes) -> int | None:
    at = body.find(marker)
    if at < 0:
        return None
    at += len(marker)
    end = at
    while end < len(body) and body[end : end + 1] in b" 0123456789":
        end += 1
    digits = body[at:end].strip()
    return int(digits) if digits else None


class _Connection(asyncio.Protocol):
    """One keep-alive client connection; at most one stream in flight, later requests wait in the buffer."""

    def __init__(self, canned: _Canned, chunks: int, delay: float, prefill: float = 0.0) -> None:
        self._canned = canned
        self._chunks = chunks
        self._delay = delay
        self._prefill = prefill
        self._loop = asyncio.get_running_loop()
        self._buffer = bytearray()
        self._transport: asyncio.Transport | None = None
        self._frames: list[bytes] = []
        self._next = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self._transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self._frames = []

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        if not self._frames:
            self._serve_buffered()

    def _serve_buffered(self) -> None:
        while not self._frames:
            transport = self._transport
            if transport is None:
                return
            head_end = self._buffer.find(b"\r\n\r\n")
            if head_end < 0:
                if len(self._buffer) > _MAX_HEAD:
                    transport.close()
                return
            head = bytes(self._buffer[:head_end]).lower()
            length = _int_after(head, b"\r\ncontent-length:") or 0
            end = head_end + 4 + length
            if len(self._buffer) < end:
                return
            body = bytes(self._buffer[head_end + 4 : end])
            del self._buffer[:end]
            self._answer(transport, head, body)
            if b"\r\nconnection: close" in head and not self._frames:
                transport.close()

    def _answer(self, transport: asyncio.Transport, head: bytes, body: bytes) -> None:
        canned = self._canned
        line = head[: head.find(b"\r\n")]
        if line.startswith(b"get /health "):
            transport.write(canned.health)
        elif line.startswith(b"get /v1/models "):
            transport.write(canned.models)
        elif line.startswith((b"post /v1/chat/completions ", b"post /v1/completions ")):
            chat = line.startswith(b"post /v1/chat/")
            if b'"stream":true' in body or b'"stream": true' in body:
                self._start_stream(transport, chat, body)
            elif self._prefill > 0:
                # Held back like a stream's first chunk; later pipelined requests wait behind it.
                self._frames, self._next = [canned.chat if chat else canned.completion], 0
                self._schedule(self._prefill)
            else:
                transport.write(canned.chat if chat else canned.completion)
        else:
            transport.write(canned.not_found)

    def _start_stream(self, transport: asyncio.Transport, chat: bool, body: bytes) -> None:
        canned = self._canned
        count = _int_after(body, b'"max_tokens":') or _int_after(body, b'"max_completion_tokens":') or self._chunks
        count = max(1, min(count, _MAX_CHUNKS))
        chunk, last = (canned.chat_chunk, canned.chat_last) if chat else (canned.text_chunk, canned.text_last)
        frames = [chunk] * (count - 1)
        frames.append(last)
        if b'"include_usage":true' in body or b'"include_usage": true' in body:
            frames.append(canned.usage_frame(chat, count))
        frames.append(canned.done)
        self._frames, self._next = frames, 0
        transport.write(canned.stream_head)
        self._schedule(max(self._prefill, self._delay))

    def _schedule(self, delay: float) -> None:
        if delay > 0:
            self._loop.call_later(delay, self._write_next)
        else:
            self._loop.call_soon(self._write_next)

    def _write_next(self) -> None:
        if self._transport is None or not self._frames:
            return
        self._transport.write(self._frames[self._next])
        self._next += 1
        if self._next < len(self._frames):
            self._schedule(self._delay)
            return
        self._frames = []
        if self._buffer:
            self._serve_buffered()


async def serve(host: str, port: int, chunks: int, delay: float, prefill: float = 0.0) -> None:
    """Serve until SIGTERM or SIGINT."""
    loop = asyncio.get_running_loop()
    canned = _Canned()
    server = await loop.create_server(lambda: _Connection(canned, chunks, delay, prefill), host, port, backlog=1024)
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    async with server:
        await stop.wait()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m loadtest.stub_engine`."""
    parser = argparse.ArgumentParser(prog="python -m loadtest.stub_engine", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--chunks", type=int, default=16, help="content chunks per stream without max_tokens")
    parser.add_argument("--chunk-delay", type=float, default=0.0, help="seconds between two stream chunks")
    parser.add_argument(
        "--prefill-delay", type=float, default=0.0, help="seconds before the first chunk or a non-streamed answer"
    )
    args = parser.parse_args(argv)
    chunks, delay, prefill = max(1, args.chunks), max(0.0, args.chunk_delay), max(0.0, args.prefill_delay)
    uvloop.run(serve(args.host, args.port, chunks, delay, prefill))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
