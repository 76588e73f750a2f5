"""The Responses API's stored state, kept by the gateway in Redis (the engine runs without its own store)."""

from gateway.responses.store import ChainError, OwnerUsage, ResponseStore, StoredResponse

__all__ = ["ChainError", "OwnerUsage", "ResponseStore", "StoredResponse"]
