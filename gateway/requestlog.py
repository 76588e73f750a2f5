"""RequestRecord: what one request did, filled in along the way and written out once at its end.

A leaf: the middleware creates it, routes and the relay fill it, the access log and metrics read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class RequestRecord:
    """One request's facts for the access-log line and the metrics; never holds a secret."""

    request_id: str
    started_at: float
    key_name: str | None = None
    model: str | None = None
    stream: bool = False
    first_chunk_at: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    client_disconnected: bool = False
    engine_error: str | None = None

    def take_usage(self, usage: Any) -> None:
        """Record the engine's `usage` object (ignored when malformed)."""
        if isinstance(usage, dict):
            prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
            if isinstance(prompt, int) and isinstance(completion, int):
                self.prompt_tokens, self.completion_tokens = prompt, completion

    @property
    def total_tokens(self) -> int | None:
        """Prompt plus completion tokens, when the engine reported them."""
        if self.prompt_tokens is None or self.completion_tokens is None:
            return None
        return self.prompt_tokens + self.completion_tokens
