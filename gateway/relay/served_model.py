"""ModelInfo: what the gateway knows of the served model, learned from the engine or set in settings.

Produced by the engine monitor, read by validation (context length, model name); what the operator set
(`ModelOverrides`, from the settings `model_name` and `context_length`) takes precedence over what the engine
lists. Imports errors only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.errors import EngineUnavailableError, NotFoundError


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

    def resolve(self, requested: str, aliases: tuple[str, ...] = ()) -> ModelInfo:
        """This model when `requested` names it or one of `aliases`, else NotFoundError (404) naming the choices."""
        return ServedModels((self,), aliases).resolve(requested)


@dataclass(frozen=True, slots=True)
class ServedModels:
    """The models the gateway serves now (those with a ready replica) and the aliases of the first: what a request's
    `model` is resolved against. `pending`: some replica's model is not known yet (it is down or starting), so a
    name not found here may yet be served: not ready (503) rather than unknown (404)."""

    models: tuple[ModelInfo, ...]
    aliases: tuple[str, ...] = ()
    pending: bool = False

    def resolve(self, requested: str) -> ModelInfo:
        """The served model `requested` names (an alias names the first), else EngineUnavailableError while a
        replica's model is still unknown and no model is served, else NotFoundError naming the choices."""
        for model in self.models:
            if model.name == requested:
                return model
        if self.models and requested in self.aliases:
            return self.models[0]
        if not self.models or (self.pending and requested not in self.aliases):
            raise EngineUnavailableError(
                f"No replica serving {requested!r} is ready (or its model is not known yet); retry shortly."
            )
        names = ", ".join(repr(n) for n in (*(m.name for m in self.models), *self.aliases))
        raise NotFoundError(f"The model {requested!r} does not exist here; use one of: {names}.", param="model")
