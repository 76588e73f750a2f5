"""The ASGI type aliases the gateway's pure-ASGI code shares (like starlette/types.py).

A leaf: imports nothing from the gateway or from web frameworks, so the middleware and the SSE
relay can both name the ASGI callables without importing each other.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]

Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

__all__ = ["ASGIApp", "Message", "Receive", "Scope", "Send"]
