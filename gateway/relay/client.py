"""EngineClient: the one pooled keep-alive HTTP client to the engine, with timeouts and error mapping.

aiohttp, not httpx, on the relay path: the overhead benchmark (loadtest/overhead.py) showed httpx's
async client costing several times more CPU per request and per chunk. Foreign errors are mapped
to gateway errors here, once. Imports settings and errors only.
"""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import Any

import aiohttp
import orjson

from gateway.errors import (
    EngineProtocolError,
    EngineRefusedError,
    EngineTimeoutError,
    EngineUnavailableError,
)
from gateway.settings import Settings


class UpstreamResponse:
    """A started engine response: status and headers are known, the body is still to be read."""

    __slots__ = ("_response", "content_type", "status")

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self.status = response.status
        self.content_type = response.headers.get("content-type", "application/json")

    @property
    def content(self) -> aiohttp.StreamReader:
        """The raw body stream (for SSE relaying)."""
        return self._response.content

    def close(self) -> None:
        """Drop the connection; the engine sees the disconnect and aborts the generation."""
        self._response.close()

    def release(self) -> None:
        """Return a fully read connection to the pool."""
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

    def _unavailable(self, why: str) -> EngineUnavailableError:
        return EngineUnavailableError(
            f"The model engine is unavailable ({why}); retry shortly.", retry_after=self._retry_after
        )

    async def open(self, path: str, body: bytes, request_id: str) -> UpstreamResponse:
        """POST `body` to `path` and wait for the status line and headers (first-byte timeout)."""
        if self._session is None:
            raise self._unavailable("the gateway is not started")
        headers = {"Content-Type": "application/json", "X-Request-Id": request_id, **self._auth_header}
        try:
            async with asyncio.timeout(self._relay.first_byte_timeout):
                response = await self._session.post(self._base_url + path, data=body, headers=headers)
        except TimeoutError:
            raise EngineTimeoutError(
                f"The model engine did not answer within {self._relay.first_byte_timeout:g} s.",
                retry_after=self._retry_after,
            ) from None
        except aiohttp.ClientConnectorError:
            raise EngineRefusedError(
                "The model engine is unavailable (connection refused); retry shortly.", retry_after=self._retry_after
            ) from None
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
            raise self._unavailable("connection lost") from None
        except aiohttp.ClientError as exc:
            raise EngineProtocolError(
                f"The model engine sent an invalid response ({type(exc).__name__}).", retry_after=self._retry_after
            ) from None
        return UpstreamResponse(response)

    async def read_body(self, upstream: UpstreamResponse) -> bytes:
        """The whole body of a non-streamed answer, bounded by the first-byte timeout."""
        try:
            async with asyncio.timeout(self._relay.first_byte_timeout):
                return await upstream._response.read()
        except TimeoutError:
            upstream.close()
            raise EngineTimeoutError(
                f"The model engine did not finish within {self._relay.first_byte_timeout:g} s.",
                retry_after=self._retry_after,
            ) from None
        except aiohttp.ClientError:
            upstream.close()
            raise self._unavailable("connection lost while reading the answer") from None

    async def get_json(self, path: str, within: float) -> Any:
        """GET a small JSON document (models list); errors mapped like `open`."""
        if self._session is None:
            raise self._unavailable("the gateway is not started")
        try:
            async with asyncio.timeout(within):
                async with self._session.get(self._base_url + path, headers=self._auth_header) as response:
                    if response.status != 200:
                        raise self._unavailable(f"{path} answered {response.status}")
                    return orjson.loads(await response.read())
        except TimeoutError:
            raise EngineTimeoutError(f"The model engine did not answer {path} in time.") from None
        except aiohttp.ClientError:
            raise self._unavailable("connection refused") from None
        except orjson.JSONDecodeError:
            raise EngineProtocolError(f"The model engine answered {path} with invalid JSON.") from None

    async def probe(self, within: float) -> str | None:
        """One /health probe: None when healthy, else why not."""
        if self._session is None:
            return "gateway not started"
        try:
            async with asyncio.timeout(within):
                async with self._session.get(self._base_url + "/health", headers=self._auth_header) as response:
                    await response.read()
                    return None if response.status == 200 else f"/health answered {response.status}"
        except TimeoutError:
            return f"/health did not answer within {within:g} s"
        except aiohttp.ClientConnectorError:
            return "connection refused"
        except aiohttp.ClientError as exc:
            return f"/health failed: {type(exc).__name__}"


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
