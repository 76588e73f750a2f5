"""The error tree: status, type and code per class, OpenAI's envelope, and Retry-After."""

from __future__ import annotations

import inspect

import orjson
import pytest

from gateway import errors
from gateway.errors import (
    SHOULD_RETRY,
    AddressBlockedError,
    AuthenticationError,
    EngineBusyError,
    EngineConnectionLostError,
    EngineCredentialsError,
    EngineProtocolError,
    EngineQueueFullError,
    EngineRefusedError,
    EngineTimeoutError,
    EngineUnavailableError,
    GatewayError,
    InternalError,
    InvalidRequestError,
    KeyStoreUnavailableError,
    MalformedRequestError,
    MethodNotAllowedError,
    MetricsForbiddenError,
    NotFoundError,
    OverloadedError,
    PermissionDeniedError,
    QuotaExceededError,
    RateLimitError,
    RequestHeadTooLargeError,
    RequestOverLimitError,
    RequestTimeoutError,
    RequestTooLargeError,
    ResponseNotFoundError,
    RouteNotFoundError,
    ServiceUnavailableError,
)

pytestmark = pytest.mark.timeout(5)

# class -> (HTTP status, type, code)
EXPECTED: dict[type[GatewayError], tuple[int, str, str | None]] = {
    GatewayError: (500, "internal_error", None),
    InternalError: (500, "internal_error", None),
    InvalidRequestError: (400, "invalid_request_error", None),
    RequestTooLargeError: (413, "invalid_request_error", "request_too_large"),
    RequestHeadTooLargeError: (431, "invalid_request_error", "request_header_too_large"),
    RequestTimeoutError: (408, "invalid_request_error", "request_timeout"),
    MalformedRequestError: (400, "invalid_request_error", "invalid_http_request"),
    MethodNotAllowedError: (405, "invalid_request_error", "method_not_allowed"),
    AuthenticationError: (401, "authentication_error", "invalid_api_key"),
    PermissionDeniedError: (403, "permission_error", "model_not_allowed"),
    MetricsForbiddenError: (403, "permission_error", "metrics_forbidden"),
    NotFoundError: (404, "invalid_request_error", "model_not_found"),
    RouteNotFoundError: (404, "invalid_request_error", "unknown_url"),
    ResponseNotFoundError: (404, "invalid_request_error", "response_not_found"),
    RateLimitError: (429, "rate_limit_error", "rate_limit_exceeded"),
    QuotaExceededError: (429, "insufficient_quota", "insufficient_quota"),
    AddressBlockedError: (429, "rate_limit_error", "rate_limit_exceeded"),
    RequestOverLimitError: (429, "rate_limit_error", "rate_limit_exceeded"),
    EngineQueueFullError: (429, "rate_limit_error", "engine_queue_full"),
    EngineBusyError: (503, "service_unavailable", "engine_busy"),
    ServiceUnavailableError: (503, "service_unavailable", "service_unavailable"),
    EngineUnavailableError: (503, "service_unavailable", "engine_unavailable"),
    EngineRefusedError: (503, "service_unavailable", "engine_unavailable"),
    EngineConnectionLostError: (503, "service_unavailable", "engine_unavailable"),
    KeyStoreUnavailableError: (503, "service_unavailable", "key_store_unavailable"),
    OverloadedError: (503, "service_unavailable", "too_many_connections"),
    EngineProtocolError: (502, "service_unavailable", "engine_protocol_error"),
    EngineCredentialsError: (502, "service_unavailable", "engine_key_refused"),
    EngineTimeoutError: (504, "service_unavailable", "engine_timeout"),
}
RETRYABLE: list[type[RateLimitError] | type[ServiceUnavailableError]] = [
    QuotaExceededError,
    AddressBlockedError,
    RequestOverLimitError,
    RateLimitError,
    EngineQueueFullError,
    EngineBusyError,
    ServiceUnavailableError,
    EngineUnavailableError,
    EngineRefusedError,
    EngineConnectionLostError,
    KeyStoreUnavailableError,
    OverloadedError,
    EngineProtocolError,
    EngineCredentialsError,
    EngineTimeoutError,
]
NOT_RETRYABLE = [cls for cls in EXPECTED if cls not in RETRYABLE]
# Refusals a retry does not cure soon: both SDKs are told not to retry them on their own.
SDK_MUST_NOT_RETRY = {QuotaExceededError, AddressBlockedError, RequestOverLimitError, EngineCredentialsError}


def test_every_public_error_class_is_covered() -> None:
    public = {
        obj
        for name, obj in vars(errors).items()
        if inspect.isclass(obj) and issubclass(obj, GatewayError) and not name.startswith("_")
    }
    assert public == set(EXPECTED)


@pytest.mark.parametrize(("cls", "expected"), EXPECTED.items(), ids=lambda v: getattr(v, "__name__", ""))
def test_status_type_and_code_come_from_the_class(
    cls: type[GatewayError], expected: tuple[int, str, str | None]
) -> None:
    error = cls("something went wrong", param="messages[0].role")
    assert (error.status_code, error.type, error.code) == expected
    assert (cls.status_code, cls.type, cls.code) == expected


@pytest.mark.parametrize("cls", list(EXPECTED), ids=lambda c: c.__name__)
def test_envelope_has_exactly_openais_four_keys(cls: type[GatewayError]) -> None:
    error = cls("The model 'x' does not exist here.", param="model")
    body = error.to_openai_body()
    assert list(body) == ["error"]
    assert body["error"] == {
        "message": "The model 'x' does not exist here.",
        "type": cls.type,
        "param": "model",
        "code": cls.code,
    }
    assert str(error) == error.message


def test_param_defaults_to_null() -> None:
    assert InvalidRequestError("bad").to_openai_body()["error"]["param"] is None


@pytest.mark.parametrize("cls", list(EXPECTED), ids=lambda c: c.__name__)
def test_to_json_is_the_envelope_serialised(cls: type[GatewayError]) -> None:
    error = cls('quote " backslash \\ newline \n unicode é ✓', param="stop")
    raw = error.to_json()
    assert isinstance(raw, bytes)
    assert orjson.loads(raw) == error.to_openai_body()


def test_retryable_list_is_every_rate_limit_and_unavailable_class() -> None:
    assert set(RETRYABLE) == {cls for cls in EXPECTED if issubclass(cls, RateLimitError | ServiceUnavailableError)}


def test_subclass_relationships() -> None:
    assert issubclass(EngineTimeoutError, ServiceUnavailableError)
    assert issubclass(EngineProtocolError, ServiceUnavailableError)
    assert issubclass(RequestTooLargeError, InvalidRequestError)
    assert issubclass(RouteNotFoundError, NotFoundError)
    assert all(issubclass(cls, GatewayError) for cls in EXPECTED)


@pytest.mark.parametrize(
    ("retry_after", "header"),
    [(0, "1"), (0.001, "1"), (0.5, "1"), (1.0, "1"), (1.2, "2"), (5, "5"), (29.01, "30")],
)
@pytest.mark.parametrize("cls", RETRYABLE, ids=lambda c: c.__name__)
def test_retry_after_is_whole_seconds_rounded_up_and_at_least_one(
    cls: type[RateLimitError] | type[ServiceUnavailableError], retry_after: float, header: str
) -> None:
    error = cls("retry later", retry_after=retry_after)
    assert error.headers["Retry-After"] == header
    assert error.retry_after == retry_after


@pytest.mark.parametrize("cls", RETRYABLE, ids=lambda c: c.__name__)
def test_refusals_a_retry_cannot_cure_soon_tell_the_sdks_not_to_retry(
    cls: type[RateLimitError] | type[ServiceUnavailableError],
) -> None:
    error = cls("retry later", retry_after=57_600)
    assert error.headers["Retry-After"] == "57600"  # the honest wait stays, for clients that schedule
    expected = {SHOULD_RETRY: "false"} if cls in SDK_MUST_NOT_RETRY else {}
    assert {k: v for k, v in error.headers.items() if k != "Retry-After"} == expected


@pytest.mark.parametrize("cls", RETRYABLE, ids=lambda c: c.__name__)
def test_retry_after_defaults_to_one_second(cls: type[RateLimitError] | type[ServiceUnavailableError]) -> None:
    assert cls("retry later").headers["Retry-After"] == "1"


def test_retry_after_keeps_other_headers() -> None:
    error = RateLimitError("slow down", retry_after=2.5, headers={"X-RateLimit-Remaining-Requests": "0"})
    assert error.headers == {"Retry-After": "3", "X-RateLimit-Remaining-Requests": "0"}


@pytest.mark.parametrize("cls", NOT_RETRYABLE, ids=lambda c: c.__name__)
def test_other_errors_carry_no_retry_after(cls: type[GatewayError]) -> None:
    assert "Retry-After" not in cls("no").headers
    assert cls("no", headers={"WWW-Authenticate": "Bearer"}).headers == {"WWW-Authenticate": "Bearer"}


def test_headers_are_copied_not_shared() -> None:
    given = {"WWW-Authenticate": "Bearer"}
    error = AuthenticationError("bad key", headers=given)
    given["X-Leak"] = "1"
    assert error.headers == {"WWW-Authenticate": "Bearer"}


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (InvalidRequestError("bad"), "invalid_request_error"),
        (AuthenticationError("who"), "authentication_error"),
        (PermissionDeniedError("no"), "permission_error"),
        (RouteNotFoundError("where"), "not_found_error"),
        (RequestTooLargeError("big"), "request_too_large"),
        (RateLimitError("slow", retry_after=3), "rate_limit_error"),
        (EngineUnavailableError("down"), "overloaded_error"),
        (EngineTimeoutError("late"), "timeout_error"),
        (InternalError("oops"), "api_error"),
    ],
)
def test_anthropic_envelope_names_anthropics_error_type(error: GatewayError, kind: str) -> None:
    assert error.to_anthropic_body() == {"type": "error", "error": {"type": kind, "message": error.message}}
