"""The routes the gateway answers, declared once.

The app's dispatcher, its 404 and 405 answers, the error envelope of each route and the metric route and API
labels are all derived from `SERVED`; the FastAPI routers implement the rows without a handler, and a test
holds them equal. A relayed API is a row with a `Relayed` descriptor (engine path, validation, wire shape);
a `{id}` segment in a path matches any one segment, a last `{name:path}` the rest of the path. Imports the
relayed handlers only (the hot rows).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from fastapi import Request

from gateway.api import conversation, stored
from gateway.api import relayed as relayed_api
from gateway.api.relayed import BeginTurn, Relayed
from gateway.api.validation import (
    Prepare,
    prepare_chat,
    prepare_completion,
    prepare_count_tokens,
    prepare_messages,
    prepare_responses,
)
from gateway.errors import GatewayError, MethodNotAllowedError, RouteNotFoundError
from gateway.relay.shapes import CHAT, COMPLETIONS, MESSAGES, RESPONSES, WireShape
from gateway.types import ASGIApp

# A completion handler answers with an ASGI app: a Response, or the SSE relay for a stream.
CompletionHandler = Callable[[Request], Awaitable[ASGIApp]]
# Anthropic's SDK sends these; vLLM's Messages API may read them.
_ANTHROPIC_HEADERS = ("anthropic-version", "anthropic-beta")


@dataclass(frozen=True, slots=True)
class ServedRoute:
    """One method on one path. A `relayed` API or a `handler` marks a hot route: the dispatcher calls it directly,
    skipping Starlette's routing and FastAPI's dependency solving (~14% of the CPU per request). `shape` gives the
    errors' envelope and the API's name."""

    method: str
    path: str
    handler: CompletionHandler | None = None
    relayed: Relayed | None = None
    shape: WireShape | None = None

    @property
    def envelope(self) -> WireShape | None:
        """The wire shape of the API the route serves (its errors' envelope), if any."""
        return self.relayed.shape if self.relayed is not None else self.shape

    @property
    def api(self) -> str | None:
        """The API the route serves (chat, completions, responses, messages), for metrics and the access log."""
        shape = self.envelope
        return shape.api if shape is not None else None

    @property
    def hot(self) -> bool:
        """Whether the dispatcher runs it itself."""
        return self.handler is not None or self.relayed is not None

    def render(self, error: GatewayError) -> bytes:
        """`error` in this route's envelope."""
        shape = self.envelope
        return shape.error_body(error) if shape is not None else error.to_json()


def _relayed(
    path: str,
    prepare: Prepare,
    shape: WireShape,
    *,
    passed_headers: tuple[str, ...] = (),
    begin_turn: BeginTurn | None = None,
    priority_header: bool = False,
) -> ServedRoute:
    relayed = Relayed(path, prepare, shape, passed_headers, begin_turn, priority_header)
    return ServedRoute("POST", path, relayed=relayed)


SERVED: tuple[ServedRoute, ...] = (
    _relayed("/v1/chat/completions", prepare_chat, CHAT),
    _relayed("/v1/completions", prepare_completion, COMPLETIONS),
    _relayed("/v1/responses", prepare_responses, RESPONSES, begin_turn=conversation.begin_turn),
    ServedRoute("GET", "/v1/responses/{id}", stored.retrieve, shape=RESPONSES),
    ServedRoute("DELETE", "/v1/responses/{id}", stored.delete, shape=RESPONSES),
    ServedRoute("GET", "/v1/responses/{id}/input_items", stored.input_items, shape=RESPONSES),
    ServedRoute("POST", "/v1/responses/{id}/cancel", stored.cancel, shape=RESPONSES),
    # vLLM's Messages request model has no `priority`: it reads the header.
    _relayed("/v1/messages", prepare_messages, MESSAGES, passed_headers=_ANTHROPIC_HEADERS, priority_header=True),
    _relayed(
        "/v1/messages/count_tokens",
        prepare_count_tokens,
        MESSAGES,
        passed_headers=_ANTHROPIC_HEADERS,
        priority_header=True,
    ),
    ServedRoute("GET", "/v1/models"),
    ServedRoute("GET", "/v1/models/{model:path}", relayed_api.retrieve_model),
    ServedRoute("GET", "/health"),
    # Load balancers probe with HEAD.
    ServedRoute("HEAD", "/health"),
    ServedRoute("GET", "/ready"),
    ServedRoute("HEAD", "/ready"),
    ServedRoute("GET", "/metrics"),
    ServedRoute("GET", "/metrics/engine"),
)


def _matches(template: tuple[str, ...], parts: list[str]) -> bool:
    if template and template[-1].endswith(":path}"):  # the rest of the path, slashes and all (a model id)
        head = len(template) - 1
        return len(parts) > head and _matches(template[:-1], parts[:head]) and all(parts[head:])
    return len(template) == len(parts) and all(
        t == p or (t.startswith("{") and p != "") for t, p in zip(template, parts, strict=True)
    )


class RouteTable:
    """Lookups derived from a table of served routes."""

    def __init__(self, routes: tuple[ServedRoute, ...] = SERVED) -> None:
        self.routes = routes
        self._by_key = {(r.method, r.path): r for r in routes if "{" not in r.path}
        self._templates = [(r, tuple(r.path.split("/"))) for r in routes if "{" in r.path]
        self._methods: dict[str, list[str]] = {}
        for route in routes:
            self._methods.setdefault(route.path, []).append(route.method)
        self.paths = frozenset(self._methods)
        # A path under a served API's own (`/v1/messages/batches`, GET `/v1/messages`) is refused in its envelope:
        # the longest static prefix of the API's paths first.
        self._families = sorted(
            ((r.path.split("{", 1)[0].rstrip("/"), r) for r in routes if r.envelope is not None),
            key=lambda family: -len(family[0]),
        )
        self._listing = ", ".join(f"{'|'.join(methods)} {path}" for path, methods in self._methods.items())

    def find(self, method: str, path: str) -> ServedRoute | None:
        """The row serving `method` on `path`, or None."""
        route = self._by_key.get((method, path))
        if route is not None or not self._templates:
            return route
        parts = path.split("/")
        return next((r for r, t in self._templates if r.method == method and _matches(t, parts)), None)

    def render_refusal(self, path: str, error: GatewayError) -> bytes:
        """`error`, the refusal of `path`, in the envelope of the served API the path lies under, else OpenAI's."""
        for prefix, route in self._families:
            if path == prefix or path.startswith(prefix + "/"):
                return route.render(error)
        return error.to_json()

    def refusal(self, method: str, path: str) -> GatewayError:
        """Why `method path` is not served: 405 (with Allow) on a served path, else 404."""
        methods = self._methods.get(path)
        if methods is None:
            # A path with an id (`/v1/responses/{id}`) is served by its template's methods.
            parts = path.split("/")
            found = [r.method for r, t in self._templates if _matches(t, parts)]
            methods = found or None
        # Only printable, bounded text from the client goes back into the message.
        shown = ascii(path[:200])[1:-1]
        if methods is not None:
            return MethodNotAllowedError(
                f"{ascii(method[:20])[1:-1]} is not allowed on {shown}; use {' or '.join(methods)}.",
                headers={"Allow": ", ".join(methods)},
            )
        return RouteNotFoundError(
            f"{ascii(method[:20])[1:-1]} {shown} is not served here; the gateway serves {self._listing}."
        )
