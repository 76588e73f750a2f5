"""ModelInfo: what the gateway knows of the served model, learned from the engine or set in settings.

Produced by the engine monitor, read by validation (context length, model name); what the operator set
(`ModelOverrides`, from the settings `model_name` and `context_length`) takes precedence over what the engine
lists. Imports errors only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.errors import EngineUnavailableError


@dataclass(frozen=True, slots=True)
class ModelOverrides:
    """What the operator set of the served model (None: learned from the engine)."""

    name: str | None = None
    context_length: int | None = None


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the gateway knows of the served model (from settings or the engine's /v1/models)."""

    name: str
    context_length: int | None

    @classmethod
    def from_listing(cls, listing: Any, overrides: ModelOverrides) -> ModelInfo:
        """The served model from the engine's /v1/models answer, `overrides` taking precedence."""
        entries = listing.get("data") if isinstance(listing, dict) else None
        if not isinstance(entries, list) or not entries or not isinstance(entries[0], dict):
            raise EngineUnavailableError("The model engine lists no model at /v1/models.")
        first = entries[0]
        name = overrides.name or str(first.get("id"))
        learned = first.get("max_model_len")
        context_length = overrides.context_length or (learned if isinstance(learned, int) else None)
        return cls(name=name, context_length=context_length)
