"""The key record as Redis holds it (one hash per key) and back: pure code, imports auth.keys only.

The hash carries the digest of the secret (`DIGEST_FIELD`), never the secret; `fields_to_key` hands it back beside
the record (the key store's Lua scripts read the same field, and the audit trail's leave it out).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Final

import orjson

from gateway.auth.keys import ApiKey, KeyLimits

DIGEST_FIELD: Final = "digest"


def limit_fields(limits: KeyLimits) -> list[str]:
    """The limit fields of a record, as field/value pairs (an unset limit is an empty value)."""
    return [
        "rpm",
        optional_int(limits.requests_per_minute),
        "tpm",
        optional_int(limits.tokens_per_minute),
        "concurrency",
        optional_int(limits.max_concurrency),
        "daily_tokens",
        optional_int(limits.daily_tokens),
        "monthly_tokens",
        optional_int(limits.monthly_tokens),
    ]


def optional_int(value: int | None) -> str:
    """An optional count as a record value ("" for none)."""
    return "" if value is None else str(value)


def key_to_fields(key: ApiKey, digest: str) -> list[str]:
    """A new record as field/value pairs (not revoked)."""
    return [
        "v",
        "1",
        "name",
        key.name,
        DIGEST_FIELD,
        digest,
        "prefix",
        key.prefix,
        "created_at",
        repr(key.created_at.timestamp()),
        "expires_at",
        "" if key.expires_at is None else repr(key.expires_at.timestamp()),
        "disabled",
        "1" if key.disabled else "0",
        "revoked",
        "0",
        *limit_fields(key.limits),
        "models",
        "" if key.models is None else orjson.dumps(key.models).decode(),
        "priority",
        optional_int(key.priority),
    ]


def text(value: bytes | str) -> str:
    """A Redis reply's bytes as text."""
    return value.decode() if isinstance(value, bytes) else value


def pairs(flat: Sequence[bytes | str]) -> dict[bytes | str, bytes | str]:
    """A flat HGETALL reply (a script's) as a mapping."""
    return dict(zip(flat[::2], flat[1::2], strict=True))


def fields_to_key(raw: Mapping[bytes | str, bytes | str]) -> tuple[ApiKey, str]:
    """The record and its digest ("" when revoked or left out) from the hash's fields."""
    fields = {text(field): text(value) for field, value in raw.items()}
    models = orjson.loads(fields["models"]) if fields.get("models") else None
    key = ApiKey(
        name=fields["name"],
        prefix=fields.get("prefix", ""),
        created_at=datetime.fromtimestamp(float(fields["created_at"]), UTC),
        expires_at=datetime.fromtimestamp(float(fields["expires_at"]), UTC) if fields.get("expires_at") else None,
        disabled=fields.get("disabled") == "1",
        revoked=fields.get("revoked") == "1",
        limits=KeyLimits(
            requests_per_minute=_parse_optional_int(fields.get("rpm")),
            tokens_per_minute=_parse_optional_int(fields.get("tpm")),
            max_concurrency=_parse_optional_int(fields.get("concurrency")),
            daily_tokens=_parse_optional_int(fields.get("daily_tokens")),
            monthly_tokens=_parse_optional_int(fields.get("monthly_tokens")),
        ),
        models=tuple(models) if models is not None else None,
        priority=_parse_optional_int(fields.get("priority")),
    )
    return key, fields.get(DIGEST_FIELD, "")


def _parse_optional_int(value: str | None) -> int | None:
    return int(value) if value else None
