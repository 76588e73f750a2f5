"""API keys: the secret's format, its keyed hash, and the key record the rest of the gateway sees.

Pure code, no I/O; imports errors only. The secret itself never leaves `generate_secret`'s
caller and `KeyHasher.digest`: records carry a digest and a short display prefix, never the secret.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum

from pydantic import SecretStr

from gateway.errors import InvalidRequestError, NotFoundError, PermissionDeniedError

SECRET_PREFIX = "sk-"
SECRET_BYTES = 32  # 256 bits from `secrets`: guessing is hopeless, so the keyed hash only guards a stolen Redis.
DISPLAY_CHARS = 6  # 36 bits shown: enough to tell keys apart in a listing, far too few to help a guesser.
INVALID_KEY_MESSAGE = "Invalid API key. Send a valid key as 'Authorization: Bearer sk-...'."

# One alphabet check for every secret we accept; anything else is rejected before any hashing or Redis work.
_SECRET_RE = re.compile(r"sk-[A-Za-z0-9_-]{32,200}")
# Names end up inside Redis keys and hash tags (`{name}`), so braces, spaces and colons are not allowed.
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class KeyState(StrEnum):
    """What a key record allows right now."""

    ACTIVE = "active"
    DISABLED = "disabled"
    EXPIRED = "expired"
    REVOKED = "revoked"


class KeyExistsError(InvalidRequestError):
    """A key with this name already exists (names are unique, revoked keys included)."""

    status_code = 409
    code = "key_exists"


class KeyNotFoundError(NotFoundError):
    """No key has this name."""

    code = "key_not_found"


class KeyRevokedError(InvalidRequestError):
    """The key is revoked for good; it cannot be changed or rotated, only replaced by a new one."""

    status_code = 409
    code = "key_revoked"


@dataclass(frozen=True, slots=True)
class KeyLimits:
    """A key's own limits; None takes the server default (`NEMOTRON_LIMITS__*`), 0 means unlimited."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrency: int | None = None
    # Token budgets per window (`NEMOTRON_LIMITS__BUDGET_TIMEZONE` days and months).
    daily_tokens: int | None = None
    monthly_tokens: int | None = None

    def __post_init__(self) -> None:
        for field in ("requests_per_minute", "tokens_per_minute", "max_concurrency", "daily_tokens", "monthly_tokens"):
            value = getattr(self, field)
            if value is not None and value < 0:
                raise InvalidRequestError(f"{field} must be 0 (unlimited) or more", param=field)


@dataclass(frozen=True, slots=True)
class ApiKey:
    """A key record as the gateway uses it; holds neither the secret nor its digest."""

    name: str
    prefix: str
    created_at: datetime
    expires_at: datetime | None = None
    disabled: bool = False
    revoked: bool = False
    limits: KeyLimits = KeyLimits()
    models: tuple[str, ...] | None = None  # None: every model served here
    # Scheduling priority (vLLM's meaning: lower is served sooner); None: NEMOTRON_LIMITS__DEFAULT_PRIORITY.
    priority: int | None = None

    @property
    def key_id(self) -> str:
        """What tells this key's record from any other: its name and the moment it was created. A rotation keeps it
        (a new secret for the same record); a key deleted and created again under the same name has a new one.
        Holds neither the secret nor its digest."""
        return f"{self.name}@{self.created_at.isoformat()}"

    def state(self, now: datetime) -> KeyState:
        """The key's state at `now` (an aware datetime)."""
        if self.revoked:
            return KeyState.REVOKED
        if self.disabled:
            return KeyState.DISABLED
        if self.expires_at is not None and now >= self.expires_at:
            return KeyState.EXPIRED
        return KeyState.ACTIVE


class KeyHasher:
    """The digest Redis stores for a secret: HMAC-SHA256 with the server secret, or plain SHA-256 without one."""

    __slots__ = ("_secret",)

    def __init__(self, secret: SecretStr | None) -> None:
        self._secret = secret.get_secret_value().encode() if secret is not None else None

    @property
    def keyed(self) -> bool:
        """Whether digests are HMACs; plain SHA-256 lets whoever reads Redis test guesses offline."""
        return self._secret is not None

    def digest(self, secret: str) -> str:
        """Hex digest of `secret`."""
        if self._secret is None:
            return hashlib.sha256(secret.encode()).hexdigest()
        return hmac.new(self._secret, secret.encode(), hashlib.sha256).hexdigest()

    @staticmethod
    def matches(stored: str, computed: str) -> bool:
        """Constant-time comparison of two digests."""
        return hmac.compare_digest(stored.encode(), computed.encode())


def generate_secret() -> str:
    """A new API key: `sk-` and 32 random bytes, url-safe base64 (43 characters)."""
    return SECRET_PREFIX + secrets.token_urlsafe(SECRET_BYTES)


def looks_like_secret(value: str) -> bool:
    """Whether `value` has the shape of one of our keys (checked before any hashing or Redis work)."""
    return _SECRET_RE.fullmatch(value) is not None


def display_prefix(secret: str) -> str:
    """What listings and logs may show of a key: `sk-` and its first few characters."""
    return secret[: len(SECRET_PREFIX) + DISPLAY_CHARS]


def validate_name(name: str) -> str:
    """`name` if it may name a key (1-64 of letters, digits, `.`, `_`, `-`), else InvalidRequestError."""
    if _NAME_RE.fullmatch(name) is None:
        raise InvalidRequestError(
            "Key names are 1-64 characters: letters, digits, '.', '_' and '-', starting with a letter or digit.",
            param="name",
        )
    return name


def validate_models(models: tuple[str, ...] | None) -> tuple[str, ...] | None:
    """Model lists as stored: None for every model, else non-empty names without duplicates."""
    if models is None:
        return None
    cleaned = tuple(dict.fromkeys(model.strip() for model in models if model.strip()))
    if not cleaned:
        raise InvalidRequestError("The list of models must name at least one model.", param="models")
    return cleaned


def validate_priority(priority: int | None) -> int | None:
    """`priority` if a key may have it (None: the server default, else a whole number of 0 or more)."""
    if priority is not None and priority < 0:
        raise InvalidRequestError("priority must be 0 (most urgent) or more", param="priority")
    return priority


def check_model(key: ApiKey, model: str) -> None:
    """Raise PermissionDeniedError unless `key` may use `model` (the served name, after alias resolution)."""
    if key.models is not None and model not in key.models:
        raise PermissionDeniedError(f"This API key may not use the model '{model}'.", param="model")
