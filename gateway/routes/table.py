"""The routes the gateway answers, declared once (issue 13).

The app's dispatcher, its 404 and 405 answers and the metric route labels are all derived from
`SERVED`; the FastAPI routers implement the rows without a handler, and a test holds them equal.
Imports the completion handlers only (the hot rows).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from fastapi import Request

from gateway.errors import GatewayError, MethodNotAllowedError, RouteNotFoundError
from gateway.routes import openai
from gateway.types import ASGIApp

# A completion handler answers with an ASGI app: a Response, or the SSE relay for a stream.
CompletionHandler = Callable[[Request], Awaitable[ASGIApp]]


@dataclass(frozen=True, slots=True)
class ServedRoute:
    """One method on one path. A `handler` marks a hot completion route: the dispatcher calls it directly,
    skipping Starlette's routing and FastAPI's dependency solving (~14% of the CPU per request)."""

    method: str
    path: str
    handler: CompletionHandler | None = None


SERVED: tuple[ServedRoute, ...] = (
    ServedRoute("POST", "/v1/chat/completions", openai.chat_completions),
    ServedRoute("POST", "/v1/completions", openai.completions),
    ServedRoute("GET", "/v1/models"),
    ServedRoute("GET", "/health"),
    # Load balancers probe with HEAD.
    ServedRoute("HEAD", "/health"),
    ServedRoute("GET", "/ready"),
    ServedRoute("HEAD", "/ready"),
    ServedRoute("GET", "/metrics"),
    ServedRoute("GET", "/metrics/engine"),
)


class RouteTable:
    """Lookups derived from a table of served routes."""

    def __init__(self, routes: tuple[ServedRoute, ...] = SERVED) -> None:
        self.routes = routes
        self._by_key = {(r.method, r.path): r for r in routes}
        self._methods: dict[str, list[str]] = {}
        for route in routes:
            self._methods.setdefault(route.path, []).append(route.method)
        self.paths = frozenset(self._methods)
        self._listing = ", ".join(f"{'|'.join(methods)} {path}" for path, methods in self._methods.items())

    def find(self, method: str, path: str) -> ServedRoute | None:
        """The row serving `method` on `path`, or None."""
        return self._by_key.get((method, path))

    def refusal(self, method: str, path: str) -> GatewayError:
        """Why `method path` is not served: 405 (with Allow) on a served path, else 404."""
        methods = self._methods.get(path)
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
