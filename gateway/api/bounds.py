"""How many list entries one request body may make the gateway walk before it is validated.

Validation checks lists entry by entry (a content part costs pydantic ~3 µs: a 2 MB body of 150,000 parts held
the event loop 0.8 s), so each route declares its lists in a `BodyBounds`, counted twice: on the raw bytes before
parsing (a key each entry carries once, like a message's `"role"`) and exactly on the parsed body before
validation. A body over a limit is a 400 naming it. Imports errors and settings only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway.errors import InvalidRequestError
from gateway.settings import Settings

# Content parts, tools and tool calls each carry one `"type"` key (so do JSON-schema nodes inside tools).
TYPE_MARKER = b'"type"'
# A message's (or an Anthropic message's) `"role"` key.
ROLE_MARKER = b'"role"'


def count_entries(value: Any, path: str) -> int:
    """How many entries the lists (or objects) at `path` hold: `"tools"`, `"messages[].content"` (`[]` steps into
    every entry of a list). What is missing or of another type counts 0: validation names it afterwards."""
    return _count(value, tuple(part for part in path.replace("[]", ".[]").split(".") if part))


def _count(value: Any, path: tuple[str, ...]) -> int:
    if not path:
        return len(value) if isinstance(value, list | dict) else 0
    head, rest = path[0], path[1:]
    if head == "[]":
        return sum(_count(entry, rest) for entry in value) if isinstance(value, list) else 0
    return _count(value.get(head), rest) if isinstance(value, dict) else 0


@dataclass(frozen=True, slots=True)
class BodyBounds:
    """The lists of one route's body that validation walks entry by entry, and how they are counted.

    `items_field` (chat messages, a batch's prompts) is capped by `max_messages`; the `entries` paths together by
    `max_list_entries`. Each marker is a key every entry carries once, counted in the raw body before it is
    parsed (None: counted after parsing only). Declare the lists a route's schema walks, then call `precount`
    on the raw body and `check` on the parsed one, both before validation.
    """

    items_field: str
    items: Callable[[dict[str, Any]], int]
    item_marker: bytes | None = None
    entries: tuple[str, ...] = ()
    entry_marker: bytes | None = None

    def precount(self, body: bytes, settings: Settings) -> None:
        """Before parsing: a 2 MB body of 60,000 messages takes ~20 ms to parse, counting a marker ~0.1 ms.

        Each entry carries its marker once, so a body with more than the cap is refused unless the marker is also
        a value (or, for `"type"`, a schema's key) thousands of times; a key written with escapes is still
        caught by `check`.
        """
        if self.item_marker is not None:
            count = body.count(self.item_marker)
            if count > settings.max_messages:
                raise InvalidRequestError(
                    f"'{self.items_field}' has about {count} entries; this gateway accepts at most "
                    f"{settings.max_messages}.",
                    param=self.items_field,
                )
        if self.entry_marker is not None:
            count = body.count(self.entry_marker)
            if count > settings.max_list_entries:
                raise InvalidRequestError(
                    f"The request has about {count} typed list entries (content parts, tools, tool calls: its "
                    f"{self.entry_marker.decode()} keys); this gateway accepts at most {settings.max_list_entries} "
                    "list entries in one request.",
                )

    def check(self, data: dict[str, Any], settings: Settings, body_size: int) -> None:
        """After parsing, before validation: the exact counts, items first (the entries are counted inside them).

        The entries are walked only in a body of `body_size` bytes that could hold more than the limit: a JSON list
        entry takes two bytes at least (`0,`), an object's four, so a smaller body cannot (most requests: the walk
        was a thirtieth of a small chat request's CPU).
        """
        count = self.items(data)
        if count > settings.max_messages:
            raise InvalidRequestError(
                f"'{self.items_field}' has {count} entries; this gateway accepts at most {settings.max_messages}.",
                param=self.items_field,
            )
        if body_size < 2 * settings.max_list_entries:
            return
        counts = {path: count_entries(data, path) for path in self.entries}
        total = sum(counts.values())
        if total > settings.max_list_entries:
            largest = max(counts, key=counts.__getitem__)
            field = largest.split("[", 1)[0].split(".", 1)[0]
            raise InvalidRequestError(
                f"The request's lists hold {total} entries ({counts[largest]} in '{largest}'); this gateway accepts "
                f"at most {settings.max_list_entries} list entries in one request.",
                param=field,
            )
