"""A minimal-CPU OTLP/HTTP trace sink for the tracing benchmark: takes every export and answers 200, reading nothing.

Raw asyncio (uvloop) HTTP/1.1, keep-alive: the body is skipped by its Content-Length and the answer is the empty
`ExportTraceServiceResponse` (zero bytes of protobuf). It counts exports and bytes (`GET /stats`), so that a run can
tell spans went out, and costs its core far less than decoding them would. Imports nothing of ours.

    python -m loadtest.otlp_sink --port P
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from collections.abc import Sequence
from typing import ClassVar, cast

import orjson
import uvloop

_ACCEPTED = b"HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\n\r\n"
_MAX_HEAD = 64 * 1024


class _Sink(asyncio.Protocol):
    """One connection: requests are parsed by their head's Content-Length and answered in order."""

    stats: ClassVar[dict[str, int]] = {"exports": 0, "bytes": 0}  # the process's totals, over every connection

    def __init__(self) -> None:
        self._buffer = b""
        self._skip = 0
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's TCPTransport, not asyncio's class

    def data_received(self, data: bytes) -> None:
        if self._skip:
            taken = min(self._skip, len(data))
            self._skip -= taken
            data = data[taken:]
            if self._skip == 0:
                self._answer(_ACCEPTED)
        self._buffer += data
        while not self._skip:
            end = self._buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buffer) > _MAX_HEAD and self._transport is not None:
                    self._transport.close()
                return
            head, self._buffer = self._buffer[:end].lower(), self._buffer[end + 4 :]
            length = 0
            marker = head.find(b"content-length:")
            if marker >= 0:
                length = int(head[marker + 15 :].split(b"\r\n", 1)[0].strip() or b"0")
            if head.startswith(b"get /stats"):
                body = orjson.dumps(_Sink.stats)
                self._answer(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
                continue
            _Sink.stats["exports"] += 1
            _Sink.stats["bytes"] += length
            taken = min(length, len(self._buffer))
            self._buffer = self._buffer[taken:]
            self._skip = length - taken
            if self._skip == 0:
                self._answer(_ACCEPTED)

    def _answer(self, raw: bytes) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(raw)


async def _serve(port: int) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server = await loop.create_server(_Sink, "127.0.0.1", port)
    async with server:
        await stop.wait()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m loadtest.otlp_sink`."""
    parser = argparse.ArgumentParser(prog="python -m loadtest.otlp_sink", description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    uvloop.run(_serve(args.port))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
