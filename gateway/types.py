"""The ASGI type aliases the gateway's pure-ASGI code shares (like starlette/types.py), and the declaration of a
library's internals that a module relies on (`LibraryInternals`).

A leaf: imports nothing from the gateway or from web frameworks, so the middleware and the SSE
relay can both name the ASGI callables without importing each other.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]

Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class LibraryInternals:
    """What a gateway module relies on in one class of a library beyond its documented API.

    Declared next to the code that relies on it, so that a test checks every name against the installed library:
    an upgrade that removes or renames one fails that test instead of a request.
    """

    library_class: type
    # The gateway's subclass of `library_class`, if any: the names it defines that the library class has too
    # must be exactly `overridden` (none shadowed by accident).
    subclass: type | None = None
    overridden: tuple[str, ...] = ()  # the library class's methods that `subclass` overrides
    used: tuple[str, ...] = ()  # its methods called and attributes read or written
    # Methods called with arguments by name: (method, the parameter names passed), so a rename fails the test too.
    called: tuple[tuple[str, tuple[str, ...]], ...] = ()


__all__ = ["ASGIApp", "LibraryInternals", "Message", "Receive", "Scope", "Send"]
