"""Relays an engine's Server-Sent Events to the client as they arrive, and watches for the client leaving.

Bytes pass through unparsed, `event:` lines and all; only a `data:` line that may carry the usage or the stream's end
is parsed, and only what the engine's own structure says there counts (`relay/shapes.py`: client text echoed in a
chunk ends nothing); a usage the client did not ask for is dropped. Silence is filled with SSE comments; a
stream that breaks or freezes ends with one error event in its API's shape (`relay/shapes.py`). Every chunk is
recorded as engine progress (one timestamp) for the engine monitor, which can also end the stream when it finds
the engine stuck. Speaks raw ASGI; imports no web framework and no HTTP client (the engine's bytes come
through `UpstreamResponse.read_chunk`, errors already mapped).

Where the server offers a `BodyWriter` in the scope (gateway/http/uvicorn_internals.py does), plain content is
relayed from the engine connection's data callback straight to the client connection, below ASGI's
per-message path: no task wake-up, no send() through the middleware chain (~20 µs a chunk on the per-message
path against nginx's ~10, measured by `python -m loadtest.overhead`), and the chunks of one read from the engine
in one write. Everything else (the first chunk, a partial line, usage, `[DONE]`, a full client buffer, whatever
arrives while the relay is busy) takes the per-message path. The client's disconnect is watched by
`relay/disconnect.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import orjson

from gateway.errors import EngineTimeoutError, EngineUnavailableError, GatewayError, ServiceUnavailableError
from gateway.metrics.instruments import GatewayMetrics
from gateway.relay.activity import EngineActivity
from gateway.relay.client import UpstreamResponse
from gateway.relay.disconnect import ClientDisconnectedError, run_until_disconnect
from gateway.relay.shapes import CHAT, WireShape
from gateway.request_record import EngineErrorKind, RequestRecord
from gateway.settings import RelaySettings
from gateway.types import Message, Receive, Scope, Send

logger = logging.getLogger(__name__)

__all__ = ["KEEP_ALIVE", "Message", "Receive", "SSERelay", "Send"]

KEEP_ALIVE = b": keep-alive\n\n"
# The scope key under which the server offers a BodyWriter for the request's response.
BODY_WRITER = "nemotron.body_writer"
_USAGE_MARKERS = (b'"usage":{', b'"usage": {')
# What the straight path looks for: both usage markers start with it (a `"usage":null` also matches, and goes the
# pump's way, which finds no usage in it).
_USAGE_KEY = b'"usage":'
_DATA = b"data:"
# A Responses event carrying the response object (created, in progress, the terminal one), as vLLM's compact JSON
# writes it; client text inside a JSON string has its quotes escaped and cannot match.
_RESPONSE_OBJECT = b'"response":{'
SSE_HEADERS: tuple[tuple[bytes, bytes], ...] = (
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    # nginx: never buffer this response, whatever the site config says.
    (b"x-accel-buffering", b"no"),
)


class Settles(Protocol):
    """What the stream settles once it ends, or just before its end goes out (the exchange's `Settlement`)."""

    async def settle(self) -> None:
        """Release what the request holds; only the first call acts."""
        ...


class BodyWriter(Protocol):
    """Writes one chunk of a started response body straight to the client's connection, synchronously."""

    def write(self, body: bytes) -> bool:
        """True when `body` was written; False (nothing written) when the ASGI send must carry it instead."""
        ...


def error_event(error: GatewayError) -> bytes:
    """One SSE event carrying OpenAI's error envelope (what the OpenAI SDK raises from mid-stream)."""
    return CHAT.error_event(error)


class _SilenceAlarm:
    """One timer per stream that interrupts a read silent for `heartbeat` (a keep-alive is due) or
    `chunk_timeout` (the engine froze) seconds, or at once when the engine monitor finds the engine stuck.

    An `asyncio.timeout` around every read cost ~10 µs a chunk; here a chunk only stores the time.
    The alarm cancels the pump only while it waits on the engine (`reading`), never mid-send.
    """

    def __init__(
        self, task: asyncio.Task[Any], heartbeat: float, chunk_timeout: float, activity: EngineActivity | None
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = task
        self._heartbeat = heartbeat
        self._chunk_timeout = chunk_timeout
        self._activity = activity
        self._last_data = self._last_beat = self._loop.time()
        self._frozen = False
        self.reading = False
        self.fired: str | None = None
        self._handle: asyncio.Handle = self._loop.call_at(self._due(), self._check)

    def _due(self) -> float:
        return min(max(self._last_data, self._last_beat) + self._heartbeat, self._last_data + self._chunk_timeout)

    def _check(self) -> None:
        now, due = self._loop.time(), self._due()
        if self._frozen:
            due = now
        if now < due or not self.reading:
            self._handle = self._loop.call_at(max(due, now + 0.05), self._check)
            return
        if self._frozen:
            self.fired = "frozen"
        else:
            self.fired = "timeout" if now - self._last_data >= self._chunk_timeout else "heartbeat"
        self._task.cancel()

    def data(self) -> None:
        """A chunk arrived: the stream is alive, and so is the engine."""
        self._last_data = self._loop.time()
        if self._activity is not None:
            self._activity.progress()

    def freeze(self) -> None:
        """The engine is stuck: interrupt the next (or current) read."""
        self._frozen = True
        self._handle.cancel()
        self._handle = self._loop.call_soon(self._check)

    def take(self) -> str | None:
        """What fired (and clear it)."""
        fired, self.fired = self.fired, None
        return fired

    def beat(self) -> None:
        """A keep-alive was sent: re-arm."""
        self._last_beat = self._loop.time()
        self._handle = self._loop.call_at(self._due(), self._check)

    def close(self) -> None:
        """Stop the timer."""
        self._handle.cancel()


class SSERelay:
    """An ASGI response that pumps one engine stream to the client."""

    def __init__(
        self,
        upstream: UpstreamResponse,
        record: RequestRecord,
        settings: RelaySettings,
        metrics: GatewayMetrics,
        *,
        strip_usage: bool,
        shape: WireShape = CHAT,
        headers: Iterable[tuple[bytes, bytes]] = (),
        settlement: Settles | None = None,
        activity: EngineActivity | None = None,
        response_fields: Mapping[str, Any] | None = None,
    ) -> None:
        self._upstream = upstream
        self._record = record
        self._settings = settings
        self._metrics = metrics
        self._strip_usage = strip_usage and shape.strips_usage
        self._shape = shape
        self._headers = [*SSE_HEADERS, *headers]
        self._saw_done = False
        self._settlement = settlement
        self._activity = activity
        self._alarm: _SilenceAlarm | None = None
        self._frozen = False
        self._writer: BodyWriter | None = None
        # Fields the gateway sets on every response object of a Responses stream (its stored state's).
        self._response_fields = response_fields
        patched = (_RESPONSE_OBJECT,) if response_fields else ()
        # What a chunk relayed straight must not hold: a usage line (the pump reads it), the end of the stream, or
        # a response object to patch.
        self._held_marks = (_USAGE_KEY, *shape.end_marks, *patched)
        # What makes the pump parse a chunk's data lines: a usage object, a candidate for the end, a response object.
        self._read_marks = (*_USAGE_MARKERS, *shape.end_marks, *patched)
        trace = record.trace
        if trace is not None and trace.recording:  # what the request's trace reads too (its finish reasons)
            self._held_marks += trace.marks
            self._read_marks += trace.marks
        # The pump waits on the engine with nothing buffered and no partial line: a chunk may go straight out.
        self._parked = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._activity is not None:
            self._activity.begin(self)
        try:
            await send({"type": "http.response.start", "status": self._upstream.status, "headers": self._headers})
            writer = scope.get(BODY_WRITER)
            if writer is not None:
                self._upstream.tap(self._relay_now)
                self._writer = writer
            await run_until_disconnect(receive, self._pump(send))
        except ClientDisconnectedError:
            # A client that hangs up right after `[DONE]` got its whole answer.
            if not self._saw_done:
                self._record.client_disconnected = True
                self._metrics.client_disconnects.labels("stream").inc()
        except asyncio.CancelledError:
            # The server cancels a response only when its shutdown grace is over: the client must learn that its
            # answer is incomplete from the stream itself, not from a cut connection; then the cancel goes on.
            await self._end_cancelled(send)
            raise
        finally:
            if self._activity is not None:
                self._activity.end(self)
            self._upstream.close()
            await self._finish()

    async def _end_cancelled(self, send: Send) -> None:
        self._parked = False  # nothing more goes out from the engine's callback
        if self._saw_done:
            return
        error = ServiceUnavailableError(
            "The gateway is shutting down and ended the stream before it finished; the answer is incomplete.",
            retry_after=self._settings.retry_after,
        )
        logger.warning("stream %s ended early: %s", self._record.request_id, error.message)
        # The response may not have started, or the client may be gone: then there is no one to tell.
        with contextlib.suppress(Exception):
            await send({"type": "http.response.body", "body": self._shape.error_event(error), "more_body": False})

    def _relay_now(self, chunk: bytes) -> bool:
        """In the engine connection's data callback: write plain content (what one read brought) straight to the
        client.

        False (the chunk is then buffered for the pump) for anything the pump must look at, or when the pump
        is not parked: what it has not sent yet must go out first.
        """
        writer, alarm = self._writer, self._alarm
        if (
            self._parked
            and writer is not None
            and alarm is not None
            and self._record.first_chunk_at is not None
            and chunk.endswith(b"\n")
        ):
            # `find`, not `in`: 0.18 against 0.27 µs on a content chunk here (CPython 3.11's `in` takes the
            # needle's buffer first), and this runs for every chunk.
            for mark in self._held_marks:
                if chunk.find(mark) >= 0:
                    break
            else:
                if writer.write(chunk):
                    alarm.data()
                    return True
        self._parked = False
        return False

    def abort_frozen(self) -> None:
        """The engine monitor found the engine stuck: end this stream with an error event."""
        self._frozen = True
        if self._alarm is not None:
            self._alarm.freeze()

    async def _pump(self, send: Send) -> None:
        upstream = self._upstream
        task = asyncio.current_task()
        assert task is not None
        alarm = self._alarm = _SilenceAlarm(
            task, self._settings.heartbeat_interval, self._settings.chunk_timeout, self._activity
        )
        if self._frozen:
            alarm.freeze()
        carry = b""
        try:
            while True:
                alarm.reading = True
                self._parked = not carry
                try:
                    chunk = await upstream.read_chunk()
                except asyncio.CancelledError:
                    # Our own alarm interrupted the read; any other cancellation goes on.
                    if alarm.fired is None or task.cancelling() > 1:
                        raise
                    task.uncancel()
                    fired = alarm.take()
                    if fired == "heartbeat":
                        await send({"type": "http.response.body", "body": KEEP_ALIVE, "more_body": True})
                        alarm.beat()
                        continue
                    await self._fail(send, *self._silence_error(fired))
                    return
                except GatewayError:
                    await self._fail(
                        send,
                        EngineErrorKind.MID_STREAM,
                        EngineUnavailableError(
                            "The model engine stopped in the middle of the stream; the answer is incomplete."
                        ),
                    )
                    return
                finally:
                    alarm.reading = self._parked = False
                if not chunk:
                    break
                alarm.data()
                if self._record.first_chunk_at is None:
                    self._record.first_chunk_at = time.perf_counter()
                if carry:
                    chunk, carry = carry + chunk, b""
                if not chunk.endswith(b"\n"):
                    # Hold back a partial line: nobody can act on it, and the usage line must be whole.
                    cut = chunk.rfind(b"\n") + 1
                    chunk, carry = chunk[:cut], chunk[cut:]
                    if not chunk:
                        continue
                ends = False
                for mark in self._read_marks:  # `find`, as on the straight path: cheaper than `in` per chunk
                    if chunk.find(mark) >= 0:
                        chunk, ends = self._read_events(chunk)
                        break
                if ends:
                    self._saw_done = True
                    # Settle before the client sees the end: its next request must find the slot free.
                    await self._finish()
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        finally:
            alarm.close()
        if not self._saw_done:
            # A line the engine cut off is not relayed (no client can parse half of it): the error event starts on a
            # line of its own, after a blank line that ends whatever event the engine left open.
            await self._fail(
                send,
                EngineErrorKind.MID_STREAM,
                EngineUnavailableError(
                    "The model engine ended the stream without finishing it; the answer is incomplete."
                ),
                lead=b"\n" if carry else b"",
            )
            return
        if carry:
            await send({"type": "http.response.body", "body": carry, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _silence_error(self, fired: str | None) -> tuple[EngineErrorKind, GatewayError]:
        if fired == "frozen":
            return EngineErrorKind.FROZEN, EngineUnavailableError(
                "The model engine stopped generating; the stream was ended and the answer is incomplete.",
                retry_after=self._settings.retry_after,
            )
        return EngineErrorKind.TIMEOUT, EngineTimeoutError(
            f"The model engine sent nothing for {self._settings.chunk_timeout:g} s; the stream was ended."
        )

    async def _finish(self) -> None:
        """Settle the exchange (releases the key's concurrency slot and reconciles its tokens), once."""
        settlement, self._settlement = self._settlement, None
        if settlement is not None:
            await settlement.settle()

    def _read_events(self, chunk: bytes) -> tuple[bytes, bool]:
        """Parse the data lines that may carry the usage or the end; record what the engine's own structure says
        (`WireShape.answer_of`), drop usage-only events the client did not ask for. The chunk to send, and whether
        it ends the stream."""
        kept: list[bytes] = []
        shape, marks = self._shape, self._read_marks
        ends = skip_blank = False
        for line in chunk.split(b"\n"):
            if skip_blank and not line:
                skip_blank = False
                continue
            skip_blank = False
            if line.startswith(_DATA) and any(mark in line for mark in marks):
                try:
                    event = orjson.loads(line[5:])
                except orjson.JSONDecodeError:
                    event = None
                if not isinstance(event, dict):
                    event = None
                elif self._response_fields and isinstance(event.get("response"), dict):
                    event["response"].update(self._response_fields)
                    line = _DATA + b" " + orjson.dumps(event)
                if event is not None and self._record.trace is not None:
                    self._record.trace.read(event)
                ends = ends or shape.ends(line, event)
                answer = shape.answer_of(event) if event is not None else None
                if answer is not None:
                    self._record.take_answer(answer)
                    if self._strip_usage and event is answer and not answer.get("choices"):
                        # The usage-only chunk the gateway asked for on the client's behalf: drop the
                        # line and the blank line that ends its event.
                        skip_blank = True
                        continue
            kept.append(line)
        return b"\n".join(kept), ends

    async def _fail(self, send: Send, kind: EngineErrorKind, error: GatewayError, lead: bytes = b"") -> None:
        # Counted by whoever settles the exchange (`settlement`), from the record: one place for every kind.
        self._record.engine_error = kind
        logger.warning("stream %s ended early: %s", self._record.request_id, error.message)
        body = lead + self._shape.error_event(error)
        await send({"type": "http.response.body", "body": body, "more_body": False})
