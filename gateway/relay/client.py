"""EngineClient: the one pooled keep-alive HTTP client to the engine, with timeouts and error mapping.

The connections and their parsing are relay/http1.py's (why not aiohttp or httpx: see there and the README's
Performance section). Its failures are mapped to gateway errors in one place, `engine_errors()` (httpx's
`map_httpcore_exceptions` pattern), used around every call here and by `UpstreamResponse`'s read methods, so
nothing else in the gateway sees them. Imports settings, errors, deadline and http1 only.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from types import TracebackType
from typing import Any

import orjson

from gateway.deadline import deadline
from gateway.errors import (
    EngineConnectionLostError,
    EngineCredentialsError,
    EngineProtocolError,
    EngineRefusedError,
    EngineTimeoutError,
    EngineUnavailableError,
)
from gateway.relay import http1
from gateway.relay.http1 import Tap
from gateway.settings import Settings

# The one-token generation probe's request ids start with this (the test engine leaves them out of its log).
PROBE_ID_PREFIX = "probe-"
# The engine's answers to a missing or wrong engine key (vLLM run with --api-key or VLLM_API_KEY).
ENGINE_KEY_REFUSED = (401, 403)
ENGINE_KEY_MESSAGE = (
    "The model engine refused the gateway's engine key; the operator must set NEMOTRON_ENGINE_API_KEY "
    "to the engine's key."
)


def map_engine_error(exc: BaseException, timeout_message: str, retry_after: float = 1.0) -> BaseException:
    """The gateway error for an engine client (relay/http1.py) or timeout exception; anything else as it is.

    ConnectFailedError -> EngineRefusedError (nothing listens); ConnectionLostError (the engine closed or reset
    the connection, a truncated body) -> EngineConnectionLostError; InvalidResponseError -> EngineProtocolError;
    TimeoutError -> EngineTimeoutError carrying `timeout_message`.
    """
    if isinstance(exc, TimeoutError):
        return EngineTimeoutError(timeout_message, retry_after=retry_after)
    if isinstance(exc, http1.ConnectFailedError):
        return EngineRefusedError(
            "The model engine is unavailable (connection refused); retry shortly.", retry_after=retry_after
        )
    if isinstance(exc, http1.ConnectionLostError):
        return EngineConnectionLostError(
            "The model engine is unavailable (connection lost); retry shortly.", retry_after=retry_after
        )
    if isinstance(exc, http1.ClientError):
        return EngineProtocolError(f"The model engine sent an invalid response ({exc}).", retry_after=retry_after)
    return exc


@contextlib.contextmanager
def engine_errors(timeout_message: str, retry_after: float = 1.0) -> Iterator[None]:
    """Raise `map_engine_error`'s gateway error for an engine client or timeout exception escaping the block."""
    try:
        yield
    except (http1.ClientError, TimeoutError) as exc:
        raise map_engine_error(exc, timeout_message, retry_after) from None


class UpstreamResponse:
    """A started engine response: status and headers are known, the body is still to be read."""

    __slots__ = ("_response", "_retry_after", "connected_at", "content_type", "status")

    def __init__(self, response: http1.Response, retry_after: float = 1.0) -> None:
        self._response = response
        self._retry_after = retry_after
        self.connected_at = response.connected_at
        self.status = response.status
        self.content_type = response.content_type or "application/json"

    async def read_chunk(self) -> bytes:
        """The next bytes of the body as they arrive (b"" at its end); errors mapped by `engine_errors`."""
        # A plain try, not `engine_errors()`: this runs per chunk, and a try costs nothing until it raises.
        try:
            return await self._response.read_chunk()
        except (http1.ClientError, TimeoutError) as exc:
            raise map_engine_error(exc, "The model engine stopped sending.", self._retry_after) from None

    async def read_body(self, within: float) -> bytes:
        """The whole body, within `within` seconds; the connection is dropped on any failure."""
        try:
            with engine_errors(f"The model engine did not finish within {within:g} s.", self._retry_after):
                async with deadline(within):
                    return await self._response.read_all()
        except BaseException:
            self.close()
            raise

    def tap(self, relay: Tap) -> None:
        """Offer the further body to `relay` where it arrives, in the connection's data callback, the chunks of one
        read from the engine together, before it is buffered for `read_chunk`; what `relay` returns True for is not
        buffered."""
        self._response.tap(relay)

    def close(self) -> None:
        """Drop the connection unless the answer is complete; the engine sees the disconnect and aborts the
        generation."""
        self._response.close()


class EngineClient:
    """Sends requests to the engine over one pool of keep-alive connections for the app's lifetime."""

    def __init__(self, settings: Settings, base_url: str | None = None) -> None:
        """A client of the engine at `base_url` (default: `settings.engine_url`)."""
        self._base_url = base_url or settings.engine_url
        self._relay = settings.relay
        self._retry_after = settings.relay.retry_after
        self._pool: http1.Pool | None = None
        auth = settings.engine_api_key
        self._auth_header = (("Authorization", f"Bearer {auth.get_secret_value()}"),) if auth is not None else ()

    @property
    def base_url(self) -> str:
        """The engine's base URL."""
        return self._base_url

    async def start(self) -> None:
        """Open the connection pool."""
        self._pool = http1.Pool(
            self._base_url,
            limit=self._relay.max_connections,
            # Below the engine's own idle timeout (uvicorn's 5 s in vllm serve), so the pool never sends a
            # request on a connection the engine is closing: that would be a spurious 503.
            keepalive_timeout=self._relay.keepalive_timeout,
            connect_timeout=self._relay.connect_timeout,
        )

    async def stop(self) -> None:
        """Close the pool (in-flight requests are closed too)."""
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    async def __aenter__(self) -> EngineClient:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    def _started(self) -> http1.Pool:
        if self._pool is None:
            raise EngineUnavailableError(
                "The model engine is unavailable (the gateway is not started); retry shortly.",
                retry_after=self._retry_after,
            )
        return self._pool

    async def open(
        self,
        path: str,
        body: bytes,
        request_id: str,
        *,
        method: str = "POST",
        headers: Mapping[str, str] | None = None,
    ) -> UpstreamResponse:
        """Send `body` to `path` (POST unless `method` says otherwise; `headers` added) and wait for the status line
        and headers (first-byte timeout)."""
        pool = self._started()
        sent = [("Content-Type", "application/json"), ("X-Request-Id", request_id), *self._auth_header]
        if headers:
            sent.extend(headers.items())
        within = self._relay.first_byte_timeout
        with engine_errors(f"The model engine did not answer within {within:g} s.", self._retry_after):
            async with deadline(within):
                response = await pool.request(method, path, sent, body)
        return UpstreamResponse(response, self._retry_after)

    async def read_body(self, upstream: UpstreamResponse) -> bytes:
        """The whole body of a non-streamed answer, bounded by the first-byte timeout."""
        return await upstream.read_body(self._relay.first_byte_timeout)

    async def _get(self, path: str, within: float, what: str) -> tuple[int, bytes, str | None]:
        """GET `path`: status, body and content type, all within `within` seconds; errors mapped."""
        pool = self._started()
        with engine_errors(f"The model engine did not answer {what} within {within:g} s.", self._retry_after):
            async with deadline(within):
                response = await pool.request("GET", path, self._auth_header)
                try:
                    return response.status, await response.read_all(), response.content_type
                finally:
                    response.close()

    async def get_json(self, path: str, within: float) -> Any:
        """GET a small JSON document (models list); errors mapped by `engine_errors`."""
        status, raw, _ = await self._get(path, within, path)
        if status in ENGINE_KEY_REFUSED:
            raise EngineCredentialsError(ENGINE_KEY_MESSAGE, retry_after=self._retry_after)
        if status != 200:
            raise EngineUnavailableError(
                f"The model engine answered {path} with HTTP {status}.", retry_after=self._retry_after
            )
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise EngineProtocolError(f"The model engine answered {path} with invalid JSON.") from None

    async def metrics(self, within: float) -> tuple[bytes, str | None]:
        """The engine's /metrics (Prometheus text) and its content type; errors mapped by `engine_errors`, a
        non-200 as unavailable."""
        status, raw, content_type = await self._get("/metrics", within, "/metrics")
        if status != 200:
            raise EngineUnavailableError(
                f"The model engine answered /metrics with HTTP {status}.", retry_after=self._retry_after
            )
        return raw, content_type

    async def health(self, within: float) -> int:
        """The status of one GET /health; errors mapped by `engine_errors`."""
        status, _, _ = await self._get("/health", within, "/health")
        return status

    async def generate(self, model: str, within: float) -> int:
        """One tiny generation (POST /v1/completions, max_tokens 1): the status once the answer is read.

        The liveness check that /health cannot give: a stopped engine core leaves /health answering 200.
        """
        pool = self._started()
        body = orjson.dumps({"model": model, "prompt": "Hi", "max_tokens": 1, "temperature": 0})
        headers = [
            ("Content-Type", "application/json"),
            ("X-Request-Id", PROBE_ID_PREFIX + os.urandom(8).hex()),
            *self._auth_header,
        ]
        with engine_errors(f"the generation probe did not finish within {within:g} s.", self._retry_after):
            async with deadline(within):
                response = await pool.request("POST", "/v1/completions", headers, body)
                try:
                    await response.read_all()
                    return response.status
                finally:
                    response.close()
