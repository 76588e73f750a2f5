"""EngineClient: the one pooled keep-alive HTTP client to the engine, with timeouts and error mapping.

aiohttp, not httpx, on the relay path: the overhead benchmark (loadtest/overhead.py) showed httpx's
async client costing several times more CPU per request and per chunk. aiohttp's exceptions are
mapped to gateway errors in one place, `engine_errors()` (httpx's `map_httpcore_exceptions`
pattern), used around every call here and by `UpstreamResponse`'s read methods, so nothing else in
the gateway imports aiohttp; what relies on aiohttp's internals (the response's stream reader) is in
`relay/aiohttp_internals.py`. Imports settings, errors and that module only.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from types import TracebackType
from typing import Any

import aiohttp
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
from gateway.relay.aiohttp_internals import Tap, adopt_reader, tap_reader, untap_reader
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
    """The gateway error for an aiohttp (or asyncio timeout) exception; anything else is returned as it is.

    ClientConnectorError -> EngineRefusedError (nothing listens); a dropped connection (server
    disconnected, reset, truncated body) -> EngineConnectionLostError; any other ClientError ->
    EngineProtocolError; TimeoutError -> EngineTimeoutError carrying `timeout_message`.
    """
    if isinstance(exc, TimeoutError):  # before ClientError: aiohttp's own timeouts are both
        return EngineTimeoutError(timeout_message, retry_after=retry_after)
    if isinstance(exc, aiohttp.ClientConnectorError):
        return EngineRefusedError(
            "The model engine is unavailable (connection refused); retry shortly.", retry_after=retry_after
        )
    if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientOSError | aiohttp.ClientPayloadError):
        return EngineConnectionLostError(
            "The model engine is unavailable (connection lost); retry shortly.", retry_after=retry_after
        )
    if isinstance(exc, aiohttp.ClientError):
        return EngineProtocolError(
            f"The model engine sent an invalid response ({type(exc).__name__}).", retry_after=retry_after
        )
    return exc


@contextlib.contextmanager
def engine_errors(timeout_message: str, retry_after: float = 1.0) -> Iterator[None]:
    """Raise `map_engine_error`'s gateway error for an aiohttp or timeout exception escaping the block."""
    try:
        yield
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise map_engine_error(exc, timeout_message, retry_after) from None


class UpstreamResponse:
    """A started engine response: status and headers are known, the body is still to be read."""

    __slots__ = ("_content", "_response", "_retry_after", "content_type", "status")

    def __init__(self, response: aiohttp.ClientResponse, retry_after: float = 1.0) -> None:
        self._response = response
        self._content = response.content
        adopt_reader(self._content)  # its buffered bytes are handed over before a connection error is raised
        self._retry_after = retry_after
        self.status = response.status
        self.content_type = response.headers.get("content-type", "application/json")

    async def read_chunk(self) -> bytes:
        """The next bytes of the body as they arrive (b"" at its end); errors mapped by `engine_errors`."""
        # A plain try, not `engine_errors()`: this runs per chunk, and a try costs nothing until it raises.
        try:
            return await self._content.readany()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise map_engine_error(exc, "The model engine stopped sending.", self._retry_after) from None

    async def read_body(self, within: float) -> bytes:
        """The whole body, within `within` seconds; the connection is dropped on any failure."""
        try:
            with engine_errors(f"The model engine did not finish within {within:g} s.", self._retry_after):
                async with deadline(within):
                    return await self._response.read()
        except BaseException:
            self.close()
            raise

    def tap(self, relay: Tap) -> bool:
        """Offer every further body chunk to `relay` where it arrives, in the connection's data callback, before
        it is buffered for `read_chunk`; a chunk `relay` returns True for is not buffered. False (and nothing
        done) when the body is not read by aiohttp's own StreamReader."""
        return tap_reader(self._content, relay)

    def close(self) -> None:
        """Drop the connection; the engine sees the disconnect and aborts the generation."""
        untap_reader(self._content)
        self._response.close()

    def release(self) -> None:
        """Return a fully read connection to the pool."""
        untap_reader(self._content)
        self._response.release()


class EngineClient:
    """Sends requests to the engine over one pooled keep-alive session for the app's lifetime."""

    def __init__(self, settings: Settings) -> None:
        self._base_url = settings.engine_url
        self._relay = settings.relay
        self._retry_after = settings.relay.retry_after
        self._session: aiohttp.ClientSession | None = None
        auth = settings.engine_api_key
        self._auth_header = {"Authorization": f"Bearer {auth.get_secret_value()}"} if auth is not None else {}

    async def start(self) -> None:
        """Open the connection pool."""
        connector = aiohttp.TCPConnector(
            limit=self._relay.max_connections,
            # Below the engine's own idle timeout (uvicorn's 5 s in vllm serve), so the pool never sends a
            # request on a connection the engine is closing: that would be a spurious 503.
            keepalive_timeout=self._relay.keepalive_timeout,
            enable_cleanup_closed=True,
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self._relay.connect_timeout),
            auto_decompress=False,
            # The engine sets no cookies; a real jar costs a lookup on every request and response.
            cookie_jar=aiohttp.DummyCookieJar(),
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
            json_serialize=lambda obj: orjson.dumps(obj).decode(),
        )

    async def stop(self) -> None:
        """Close the pool (in-flight requests are closed too)."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> EngineClient:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    def _started(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise EngineUnavailableError(
                "The model engine is unavailable (the gateway is not started); retry shortly.",
                retry_after=self._retry_after,
            )
        return self._session

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
        session = self._started()
        sent = {**(headers or {}), "Content-Type": "application/json", "X-Request-Id": request_id}
        sent.update(self._auth_header)
        within = self._relay.first_byte_timeout
        with engine_errors(f"The model engine did not answer within {within:g} s.", self._retry_after):
            async with deadline(within):
                response = await session.request(method, self._base_url + path, data=body, headers=sent)
        return UpstreamResponse(response, self._retry_after)

    async def read_body(self, upstream: UpstreamResponse) -> bytes:
        """The whole body of a non-streamed answer, bounded by the first-byte timeout."""
        return await upstream.read_body(self._relay.first_byte_timeout)

    async def get_json(self, path: str, within: float) -> Any:
        """GET a small JSON document (models list); errors mapped by `engine_errors`."""
        session = self._started()
        with engine_errors(f"The model engine did not answer {path} within {within:g} s.", self._retry_after):
            async with deadline(within):
                async with session.get(self._base_url + path, headers=self._auth_header) as response:
                    if response.status in ENGINE_KEY_REFUSED:
                        raise EngineCredentialsError(ENGINE_KEY_MESSAGE, retry_after=self._retry_after)
                    if response.status != 200:
                        raise EngineUnavailableError(
                            f"The model engine answered {path} with HTTP {response.status}.",
                            retry_after=self._retry_after,
                        )
                    raw = await response.read()
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise EngineProtocolError(f"The model engine answered {path} with invalid JSON.") from None

    async def metrics_text(self, within: float) -> str:
        """The engine's /metrics (Prometheus text); errors mapped by `engine_errors`, a non-200 as unavailable."""
        session = self._started()
        with engine_errors(f"/metrics did not answer within {within:g} s.", self._retry_after):
            async with deadline(within):
                async with session.get(self._base_url + "/metrics", headers=self._auth_header) as response:
                    if response.status != 200:
                        raise EngineUnavailableError(
                            f"The model engine answered /metrics with HTTP {response.status}.",
                            retry_after=self._retry_after,
                        )
                    return await response.text()

    async def health(self, within: float) -> int:
        """The status of one GET /health; errors mapped by `engine_errors`."""
        session = self._started()
        with engine_errors(f"/health did not answer within {within:g} s.", self._retry_after):
            async with deadline(within):
                async with session.get(self._base_url + "/health", headers=self._auth_header) as response:
                    await response.read()
                    return response.status

    async def generate(self, model: str, within: float) -> int:
        """One tiny generation (POST /v1/completions, max_tokens 1): the status once the answer is read.

        The liveness check that /health cannot give: a stopped engine core leaves /health answering 200.
        """
        session = self._started()
        body = orjson.dumps({"model": model, "prompt": "Hi", "max_tokens": 1, "temperature": 0})
        headers = {
            "Content-Type": "application/json",
            "X-Request-Id": PROBE_ID_PREFIX + os.urandom(8).hex(),
            **self._auth_header,
        }
        with engine_errors(f"the generation probe did not finish within {within:g} s.", self._retry_after):
            async with deadline(within):
                async with session.post(self._base_url + "/v1/completions", data=body, headers=headers) as response:
                    await response.read()
                    return response.status


def engine_error_body(status: int, body: bytes) -> bytes:
    """An engine's error answer in OpenAI's envelope: kept when it already is one, else wrapped."""
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        parsed = None
    if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict) and "message" in parsed["error"]:
        return body
    detail = body.decode("utf-8", "replace").strip()[:300] or "no details"
    return orjson.dumps(
        {
            "error": {
                "message": f"The model engine answered HTTP {status}: {detail}",
                "type": "engine_error",
                "param": None,
                "code": status,
            }
        }
    )
