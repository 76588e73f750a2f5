"""API keys: format, hashing, the Redis key store. The `keys` CLI verbs live in `gateway.auth.cli`."""

from gateway.auth.keys import (
    INVALID_KEY_MESSAGE,
    ApiKey,
    KeyExistsError,
    KeyHasher,
    KeyLimits,
    KeyNotFoundError,
    KeyRevokedError,
    KeyState,
    check_model,
    display_prefix,
    generate_secret,
)
from gateway.auth.store import KeyStore

__all__ = [
    "INVALID_KEY_MESSAGE",
    "ApiKey",
    "KeyExistsError",
    "KeyHasher",
    "KeyLimits",
    "KeyNotFoundError",
    "KeyRevokedError",
    "KeyState",
    "KeyStore",
    "check_model",
    "display_prefix",
    "generate_secret",
]
