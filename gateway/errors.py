"""The gateway's exception tree and its mapping to OpenAI's error envelope.

Imports nothing from the gateway or from web frameworks, so every layer may raise these.

    GatewayError                      status_code, type, code; fields message, param, headers
     ├─ InvalidRequestError      400  invalid_request_error
     │   ├─ RequestTooLargeError 413  invalid_request_error   code=request_too_large
     │   ├─ RequestHeadTooLargeError 431                  code=request_header_too_large
     │   ├─ RequestTimeoutError  408                      code=request_timeout
     │   ├─ MalformedRequestError 400                     code=invalid_http_request
     │   └─ MethodNotAllowedError 405                     code=method_not_allowed, + Allow
     ├─ AuthenticationError      401  authentication_error    code=invalid_api_key
     ├─ PermissionDeniedError    403  permission_error        code=model_not_allowed
     │   └─ MetricsForbiddenError 403                     code=metrics_forbidden
     ├─ NotFoundError            404  invalid_request_error   code=model_not_found
     │   ├─ RouteNotFoundError   404  invalid_request_error   code=unknown_url
     │   └─ ResponseNotFoundError 404                     code=response_not_found
     ├─ RateLimitError           429  rate_limit_error        code=rate_limit_exceeded, + Retry-After
     │   ├─ QuotaExceededError   429  insufficient_quota      code=insufficient_quota (a spent token budget) *
     │   ├─ AddressBlockedError  429  (repeated failed authentication from the client's address) *
     │   ├─ RequestOverLimitError 429 (larger than the key's per-minute token limit) *
     │   └─ EngineQueueFullError 429                      code=engine_queue_full (this priority tier's bound)
     ├─ InternalError            500  internal_error
     └─ ServiceUnavailableError  503  service_unavailable     + Retry-After
         ├─ EngineUnavailableError    503  code=engine_unavailable
         │   ├─ EngineRefusedError    503  (connection refused: the engine is down)
         │   └─ EngineConnectionLostError 503  (the connection dropped mid-exchange)
         ├─ KeyStoreUnavailableError  503  code=key_store_unavailable
         ├─ OverloadedError           503  code=too_many_connections
         ├─ EngineBusyError           503  code=engine_busy (the engine itself is full)
         ├─ EngineProtocolError       502  code=engine_protocol_error
         ├─ EngineCredentialsError    502  code=engine_key_refused (the operator's engine key) *
         └─ EngineTimeoutError        504  code=engine_timeout

Both SDKs retry a 408, 409, 429 or 5xx on their own (twice by default), sleeping its `retry-after-ms` or
`Retry-After`: OpenAI's up to two minutes (a longer one raises at once), Anthropic's for any length (a budget
refilling at midnight would hang the call for hours). The errors marked * are not cured by a retry soon: they send
`x-should-retry: false`, which both SDKs obey, and keep the honest `Retry-After` for clients that schedule.

The HTTP status comes from the class, never from message text: OpenAI SDKs pick the exception
class they raise from the status, so the status is what must be right. The Anthropic Messages routes render
the same errors in Anthropic's envelope (`to_anthropic_body`), whose `type` is derived from the status
(`anthropic_error_type`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

import orjson

# Anthropic's error types by status (its SDK picks the exception class from the status as well).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}
# The header both SDKs read before their own retry rules (OpenAI's and Anthropic's `_should_retry`).
SHOULD_RETRY = "x-should-retry"


def anthropic_error_type(status: int) -> str:
    """Anthropic's error `type` for an HTTP status (its SDK picks the exception class from the status)."""
    kind = _ANTHROPIC_TYPES.get(status)
    if kind is not None:
        return kind
    return "invalid_request_error" if status < 500 else "api_error"


class GatewayError(Exception):
    """Base of every failure the gateway answers itself; rendered as OpenAI's error envelope."""

    status_code: ClassVar[int] = 500
    type: ClassVar[str] = "internal_error"
    code: ClassVar[str | None] = None
    # Why, as a class for the metrics and the access log (a 429's limit, a 401's cause); never sent to the client.
    cause: str | None = None

    def __init__(self, message: str, *, param: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers: dict[str, str] = dict(headers or {})

    def to_openai_body(self) -> dict[str, Any]:
        """The error as OpenAI's envelope: `{"error": {"message", "type", "param", "code"}}`."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def to_json(self) -> bytes:
        """The envelope serialised, ready to be sent as a body or an SSE data line."""
        return orjson.dumps(self.to_openai_body())

    def to_anthropic_body(self) -> dict[str, Any]:
        """The error as Anthropic's envelope: `{"type": "error", "error": {"type", "message"}}`."""
        return {"type": "error", "error": {"type": anthropic_error_type(self.status_code), "message": self.message}}

    def to_anthropic_json(self) -> bytes:
        """Anthropic's envelope serialised."""
        return orjson.dumps(self.to_anthropic_body())


class InvalidRequestError(GatewayError):
    """The request cannot be served as sent; `param` names the offending field."""

    status_code = 400
    type = "invalid_request_error"


class RequestTooLargeError(InvalidRequestError):
    """The body exceeds the configured size limit."""

    status_code = 413
    code = "request_too_large"


class RequestHeadTooLargeError(InvalidRequestError):
    """The request line and headers exceed the configured size limit (answered by the HTTP server)."""

    status_code = 431
    code = "request_header_too_large"


class RequestTimeoutError(InvalidRequestError):
    """The client sent its request (head or body) too slowly."""

    status_code = 408
    code = "request_timeout"


class MalformedRequestError(InvalidRequestError):
    """The bytes received are not an HTTP/1.1 request (answered by the HTTP server, which then closes)."""

    code = "invalid_http_request"


class MethodNotAllowedError(InvalidRequestError):
    """A served path asked with a method it does not answer; `Allow` lists the ones it does."""

    status_code = 405
    code = "method_not_allowed"


class AuthenticationError(GatewayError):
    """Missing, malformed, unknown, revoked, disabled or expired API key (one message for all)."""

    status_code = 401
    type = "authentication_error"
    code = "invalid_api_key"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
        cause: str = "invalid",
    ) -> None:
        # cause: missing, malformed, unknown, inactive (revoked, disabled, expired) or blocked; one message for all.
        super().__init__(message, param=param, headers=headers)
        self.cause = cause


class PermissionDeniedError(GatewayError):
    """The key is valid but may not use what it asked for."""

    status_code = 403
    type = "permission_error"
    code = "model_not_allowed"


class MetricsForbiddenError(PermissionDeniedError):
    """A scrape of /metrics from outside the allowed networks without the metrics token."""

    code = "metrics_forbidden"


class NotFoundError(GatewayError):
    """The requested model (or route) does not exist here."""

    status_code = 404
    type = "invalid_request_error"
    code = "model_not_found"


class RouteNotFoundError(NotFoundError):
    """A path (or method) the gateway does not serve; the engine's other paths are never proxied."""

    code = "unknown_url"


class ResponseNotFoundError(NotFoundError):
    """A stored Responses API answer that does not exist, is another key's, or is not kept (the store is off)."""

    code = "response_not_found"


class InternalError(GatewayError):
    """An unexpected failure inside the gateway; the message stays generic."""


class _RetryableError(GatewayError):
    """An error that carries `Retry-After` (whole seconds, at least 1); `x-should-retry: false` as well where a
    retry cannot cure it soon (`sdk_retry`, see the module docstring)."""

    sdk_retry: ClassVar[bool] = True

    def __init__(
        self,
        message: str,
        *,
        retry_after: float = 1.0,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        merged = {"Retry-After": str(max(1, math.ceil(retry_after)))}
        if not self.sdk_retry:
            merged[SHOULD_RETRY] = "false"
        merged.update(headers or {})
        super().__init__(message, param=param, headers=merged)
        self.retry_after = retry_after


class RateLimitError(_RetryableError):
    """A limit of the key (or of the client address) is exhausted; retry after `Retry-After`."""

    status_code = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"

    def __init__(
        self,
        message: str,
        *,
        retry_after: float = 1.0,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
        limit: str = "requests",
    ) -> None:
        # limit: the exhausted one, for the metrics: requests, tokens, concurrency or failed_auth.
        super().__init__(message, retry_after=retry_after, param=param, headers=headers)
        self.cause = limit


class QuotaExceededError(RateLimitError):
    """A token budget of the key (daily or monthly) is spent; `Retry-After` is the end of its window. `tokens_left`:
    what the tightest budget still holds (a smaller request may fit it)."""

    type = "insufficient_quota"
    code = "insufficient_quota"
    sdk_retry = False

    def __init__(
        self,
        message: str,
        *,
        retry_after: float = 1.0,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
        limit: str = "budget",
        tokens_left: int = 0,
    ) -> None:
        super().__init__(message, retry_after=retry_after, param=param, headers=headers, limit=limit)
        self.tokens_left = tokens_left


class AddressBlockedError(RateLimitError):
    """The client's address failed authentication too often; it is answered 429 until its block ends."""

    sdk_retry = False

    def __init__(
        self,
        message: str,
        *,
        retry_after: float = 1.0,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
        limit: str = "failed_auth",
    ) -> None:
        super().__init__(message, retry_after=retry_after, param=param, headers=headers, limit=limit)


class RequestOverLimitError(RateLimitError):
    """The request alone asks more tokens than the key's per-minute token limit: no wait lets it pass."""

    sdk_retry = False


class EngineQueueFullError(RateLimitError):
    """The engine's queue reached the bound of this request's priority tier; retry after `Retry-After`."""

    code = "engine_queue_full"


class ServiceUnavailableError(_RetryableError):
    """A part the gateway depends on is down; retry after `Retry-After`."""

    status_code = 503
    type = "service_unavailable"
    code = "service_unavailable"


class EngineBusyError(ServiceUnavailableError):
    """The engine itself is full (its KV cache at the bound, or its own queue bound refused the request)."""

    code = "engine_busy"


class EngineUnavailableError(ServiceUnavailableError):
    """The engine is not running, not ready, or refused the connection."""

    code = "engine_unavailable"


class EngineRefusedError(EngineUnavailableError):
    """Nothing listens on the engine's port: it is down, so requests are refused fast until a probe succeeds."""


class EngineConnectionLostError(EngineUnavailableError):
    """The engine closed or reset the connection during an exchange (it died, or restarted)."""


class KeyStoreUnavailableError(ServiceUnavailableError):
    """Redis (keys and limits) does not answer; the gateway fails closed."""

    code = "key_store_unavailable"


class OverloadedError(ServiceUnavailableError):
    """The gateway holds as many client connections as it may; new ones are refused until some close."""

    code = "too_many_connections"


class EngineProtocolError(ServiceUnavailableError):
    """The engine answered with something that is not a valid HTTP/OpenAI response."""

    status_code = 502
    code = "engine_protocol_error"


class EngineCredentialsError(ServiceUnavailableError):
    """The engine refused the gateway's own key (401/403): `NEMOTRON_ENGINE_API_KEY` is unset or not the engine's.
    The operator's configuration, never the client's key, so never a 401 to the client."""

    status_code = 502
    code = "engine_key_refused"
    sdk_retry = False


class EngineTimeoutError(ServiceUnavailableError):
    """The engine did not answer (or stopped streaming) within the configured timeout."""

    status_code = 504
    code = "engine_timeout"
