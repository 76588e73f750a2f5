"""The HTTP edge's pieces alone: the served-route table, log escaping, the /ready cache, forwarded addresses.

No sockets: the app is built but not started, middleware is driven with hand-made ASGI scopes.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from fastapi.routing import APIRoute

from gateway.api import SERVED, RouteTable
from gateway.api.health import Readiness
from gateway.app import create_app
from gateway.errors import MethodNotAllowedError, RouteNotFoundError
from gateway.http.middleware import ForwardedClientMiddleware, loggable
from gateway.settings import Settings
from gateway.types import Message, Receive, Scope, Send

pytestmark = pytest.mark.timeout(10)


def test_fastapi_serves_exactly_the_tables_rows_without_a_handler() -> None:
    app = create_app(Settings())
    routed = {(method, route.path) for route in app.routes if isinstance(route, APIRoute) for method in route.methods}
    declared = {(row.method, row.path) for row in SERVED if not row.hot}
    assert routed == declared


def test_hot_rows_are_the_relayed_apis_and_the_stored_responses() -> None:
    assert {(row.method, row.path, row.api) for row in SERVED if row.hot} == {
        ("POST", "/v1/chat/completions", "chat"),
        ("POST", "/v1/completions", "completions"),
        ("POST", "/v1/responses", "responses"),
        ("GET", "/v1/responses/{id}", "responses"),
        ("DELETE", "/v1/responses/{id}", "responses"),
        ("GET", "/v1/responses/{id}/input_items", "responses"),
        ("POST", "/v1/responses/{id}/cancel", "responses"),
        ("POST", "/v1/messages", "messages"),
        ("POST", "/v1/messages/count_tokens", "messages"),
        ("GET", "/v1/models/{model:path}", None),
    }


def test_a_model_path_takes_the_rest_of_the_path_slashes_and_all() -> None:
    table = RouteTable()
    for path in ("/v1/models/nemotron", "/v1/models/nvidia/NVIDIA-Nemotron-Nano-9B-v2"):
        found = table.find("GET", path)
        assert found is not None and found.path == "/v1/models/{model:path}", path
    assert table.find("GET", "/v1/models/") is None
    assert table.find("GET", "/v1/models/a//b") is None
    assert table.find("POST", "/v1/models/nemotron") is None


def test_a_path_with_an_id_finds_its_templated_row_and_nothing_else() -> None:
    table = RouteTable()
    found = table.find("GET", "/v1/responses/resp_abc")
    assert found is not None and found.path == "/v1/responses/{id}"
    cancel = table.find("POST", "/v1/responses/resp_abc/cancel")
    assert cancel is not None and cancel.path == "/v1/responses/{id}/cancel"
    assert table.find("GET", "/v1/responses/") is None
    assert table.find("GET", "/v1/responses/a/b") is None
    deleted = table.find("DELETE", "/v1/responses/resp_abc")
    assert deleted is not None and deleted.path == "/v1/responses/{id}"
    items = table.find("GET", "/v1/responses/resp_abc/input_items")
    assert items is not None and items.path == "/v1/responses/{id}/input_items"
    assert table.find("PUT", "/v1/responses/resp_abc") is None


def test_the_404_lists_what_is_served_and_405_names_the_allowed_methods() -> None:
    table = RouteTable()
    missing = table.refusal("GET", "/v1/embeddings")
    assert isinstance(missing, RouteNotFoundError)
    assert "GET|HEAD /health" in missing.message and "POST /v1/chat/completions" in missing.message
    wrong = table.refusal("DELETE", "/v1/completions")
    assert isinstance(wrong, MethodNotAllowedError)
    assert wrong.headers == {"Allow": "POST"}


def test_a_refusal_echoes_no_control_characters_and_a_bounded_path() -> None:
    error = RouteTable().refusal("GET", "/\r\n\x1b[31m" + "a" * 10_000)
    assert "\r" not in error.message and "\x1b" not in error.message
    assert len(error.message) < 1000


@pytest.mark.parametrize(
    ("raw", "logged"),
    [
        ("/v1/chat/completions", "/v1/chat/completions"),
        ("/x\r\nINFO forged", "/x\\r\\nINFO forged"),
        ("/\x1b[31mred", "/\\x1b[31mred"),
        ('/a"b\\c', '/a\\"b\\\\c'),
        ("/caf\u00e9", "/caf\u00e9"),
        ("/\u2028\u202e", "/\\u2028\\u202e"),
        ("\x00", "\\x00"),
    ],
)
def test_loggable_escapes_what_could_forge_or_colour_a_line(raw: str, logged: str) -> None:
    assert loggable(raw) == logged
    assert "\n" not in loggable(raw) and "\r" not in loggable(raw)


async def test_readiness_pings_redis_once_per_ttl_however_often_it_is_asked() -> None:
    calls = 0

    async def ping() -> str | None:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.01)
        return None

    readiness = Readiness(ttl=60)
    assert await asyncio.gather(*(readiness.redis(ping) for _ in range(50))) == [None] * 50
    assert [await readiness.redis(ping) for _ in range(50)] == [None] * 50
    assert calls == 1


async def test_readiness_asks_again_once_the_answer_is_stale() -> None:
    answers = iter(["Redis does not answer (ConnectionError)", None])

    async def ping() -> str | None:
        return next(answers)

    readiness = Readiness(ttl=0)
    assert await readiness.redis(ping) == "Redis does not answer (ConnectionError)"
    assert await readiness.redis(ping) is None


async def _forwarded(client: tuple[str, int], header: bytes | None, trusted: str = "127.0.0.1") -> Any:
    seen: dict[str, Any] = {}

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen["client"] = scope["client"]

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        pass

    headers = [(b"x-forwarded-for", header)] if header is not None else []
    scope = {"type": "http", "client": client, "headers": headers, "scheme": "http"}
    await ForwardedClientMiddleware(app, trusted)(scope, receive, send)
    return seen["client"]


@pytest.mark.parametrize(
    ("header", "host"),
    [
        (b"203.0.113.7", "203.0.113.7"),
        (b"10.0.0.1, 203.0.113.7", "203.0.113.7"),
        (b"::ffff:1.2.3.4", "::ffff:1.2.3.4"),
        (b"not-an-address", "127.0.0.1"),
        (b"203.0.113.7\x1b[31m", "127.0.0.1"),
        (b"999.1.1.1", "127.0.0.1"),
        (None, "127.0.0.1"),
    ],
)
async def test_forwarded_for_from_a_trusted_peer_is_taken_only_when_it_is_an_address(
    header: bytes | None, host: str
) -> None:
    assert (await _forwarded(("127.0.0.1", 5000), header))[0] == host


async def test_forwarded_for_from_an_untrusted_peer_is_ignored() -> None:
    assert await _forwarded(("198.51.100.2", 5000), b"203.0.113.7") == ("198.51.100.2", 5000)


def test_a_wrong_method_on_a_path_with_an_id_is_a_405_naming_its_templates_methods() -> None:
    wrong = RouteTable().refusal("PUT", "/v1/responses/resp_abc")
    assert isinstance(wrong, MethodNotAllowedError)
    assert wrong.headers == {"Allow": "GET, DELETE"}
    assert isinstance(RouteTable().refusal("PUT", "/v1/responses/resp_abc/nothing"), RouteNotFoundError)
