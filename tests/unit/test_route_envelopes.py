"""Each route's errors in its own envelope (404/405 under the Messages paths, the engine's error answers on the
Messages routes), where each relayed API's engine reads a priority, which header carries the key, and an error event
after a stream cut mid-line: what an SDK of each API gets to see."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from starlette.requests import Request

from gateway.api import RouteTable
from gateway.api.context import bearer_token
from gateway.api.relayed import PRIORITY_HEADER
from gateway.api.validation import PreparedRequest
from gateway.relay.shapes import CHAT, MESSAGES, RESPONSES
from tests.unit.test_sse import Harness, delta

pytestmark = pytest.mark.timeout(10)

# vLLM 0.32's answer to a body its own request model refuses, on every path (/v1/messages included).
VLLM_VALIDATION = orjson.dumps(
    {
        "error": {
            "message": "1 validation error:\n  {'type': 'missing', 'loc': ('body', 'tools', 0, 'input_schema')}",
            "type": "Bad Request",
            "param": "body.tools.0.input_schema",
            "code": 400,
        }
    }
)
# vLLM's own Anthropic envelope names its Python exception as the type.
VLLM_ANTHROPIC_500 = orjson.dumps({"type": "error", "error": {"type": "InternalServerError", "message": "boom"}})


def _anthropic(body: bytes) -> dict[str, Any]:
    parsed = orjson.loads(body)
    assert set(parsed) == {"type", "error"} and parsed["type"] == "error", parsed
    assert set(parsed["error"]) == {"type", "message"}, parsed
    error: dict[str, Any] = parsed["error"]
    return error


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("POST", "/v1/messages/batches", 404),
        ("GET", "/v1/messages/batches/msgbatch_1/results", 404),
        ("GET", "/v1/messages", 405),
        ("GET", "/v1/messages/count_tokens", 405),
    ],
)
def test_a_refusal_under_the_messages_paths_is_anthropics_envelope(method: str, path: str, status: int) -> None:
    table = RouteTable()
    refusal = table.refusal(method, path)
    assert refusal.status_code == status
    error = _anthropic(table.render_refusal(path, refusal))
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert error["message"] == refusal.message


@pytest.mark.parametrize("path", ["/v1/embeddings", "/v1/chat/completions/x", "/v1/messagesx", "/"])
def test_a_refusal_elsewhere_is_openais_envelope(path: str) -> None:
    table = RouteTable()
    refusal = table.refusal("POST", path)
    assert set(orjson.loads(table.render_refusal(path, refusal))["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize(
    ("status", "body", "kind", "said"),
    [
        (400, VLLM_VALIDATION, "invalid_request_error", "input_schema"),
        (500, VLLM_ANTHROPIC_500, "api_error", "boom"),
        (
            429,
            b'{"error": {"message": "slow down", "type": "RateLimitError", "code": 429}}',
            "rate_limit_error",
            "slow",
        ),
        (404, b'{"detail": "Not Found"}', "not_found_error", "Not Found"),
        (500, b"Internal Server Error", "api_error", "Internal Server Error"),
        (502, b"", "api_error", "no details"),
    ],
)
def test_the_engines_error_answers_are_anthropics_envelope_on_the_messages_routes(
    status: int, body: bytes, kind: str, said: str
) -> None:
    error = _anthropic(MESSAGES.engine_error_body(status, body))
    assert error["type"] == kind and said in error["message"]


@pytest.mark.parametrize("shape", [CHAT, RESPONSES], ids=lambda s: s.api)
def test_the_engines_error_answers_stay_openais_envelope_on_the_openai_routes(shape: Any) -> None:
    assert shape.engine_error_body(400, VLLM_VALIDATION) == VLLM_VALIDATION
    wrapped = orjson.loads(shape.engine_error_body(500, VLLM_ANTHROPIC_500))["error"]
    assert wrapped["code"] == 500 and "boom" in wrapped["message"]


def _request(*headers: tuple[str, str]) -> Request:
    raw = [(name.lower().encode(), value.encode()) for name, value in headers]
    return Request({"type": "http", "method": "POST", "path": "/", "headers": raw})


PREPARED = PreparedRequest(b'{"model":"m"}', "m", False, False, 1, 4)


@pytest.mark.parametrize(
    ("path", "in_header"),
    [
        ("/v1/chat/completions", False),
        ("/v1/completions", False),
        ("/v1/responses", False),
        ("/v1/messages", True),
        ("/v1/messages/count_tokens", True),
    ],
)
def test_each_relayed_api_sends_the_priority_where_its_engine_reads_it(path: str, in_header: bool) -> None:
    route = RouteTable().find("POST", path)
    assert route is not None and route.relayed is not None
    body, headers = route.relayed.engine_request(_request(("anthropic-version", "2023-06-01")), PREPARED, 5)
    # vLLM 0.32's Messages request model has no `priority`: a body field there is dropped, the header is read.
    assert (orjson.loads(body).get("priority"), headers.get(PRIORITY_HEADER)) == (
        (None, "5") if in_header else (5, None)
    )
    assert ("anthropic-version" in headers) is path.startswith("/v1/messages")
    assert route.relayed.engine_request(_request(), PREPARED, None) == (PREPARED.body, {})


@pytest.mark.parametrize(
    ("headers", "token"),
    [
        ((("Authorization", "Basic dXNlcjpwYXNz"), ("x-api-key", "sk-anthropic")), "sk-anthropic"),
        ((("Authorization", "Bearer sk-openai"), ("x-api-key", "sk-anthropic")), "sk-openai"),
        ((("Authorization", "Bearer  "), ("x-api-key", "sk-anthropic")), "sk-anthropic"),
        ((("Authorization", "Basic dXNlcjpwYXNz"),), None),
        ((("x-api-key", " sk-anthropic "),), "sk-anthropic"),
        ((), None),
    ],
)
def test_a_bearer_token_wins_and_another_authorization_scheme_does_not_hide_x_api_key(
    headers: tuple[tuple[str, str], ...], token: str | None
) -> None:
    assert bearer_token(_request(*headers)) == token


@pytest.mark.parametrize("shape", [CHAT, MESSAGES], ids=lambda s: s.api)
async def test_an_error_event_after_a_stream_cut_mid_line_is_an_event_of_its_own(shape: Any) -> None:
    whole = delta("a") if shape is CHAT else b'event: message_start\ndata: {"type":"message_start"}\n\n'
    torn = b'data: {"id":"c1","choices":[{"delta":{"content":"b' if shape is CHAT else b"event: content_block_de"
    harness = Harness([whole, torn, b""], shape=shape)
    await harness.run()
    raw = b"".join(message["body"] for message in harness.client.bodies)
    assert raw.startswith(whole)
    # What an SSE reader dispatches after the whole events: the error event alone, its data one JSON object.
    events = [block for block in raw[len(whole) :].split(b"\n\n") if block.strip(b"\n")]
    assert len(events) == 1, raw
    lines = events[0].strip(b"\n").split(b"\n")
    data = orjson.loads(lines[-1].removeprefix(b"data: "))
    assert ("error" in data) and all(line.startswith((b"event: error", b"data: ")) for line in lines), lines
