"""KeyAudit: the trail of changes to API keys (who, when, which key, the fields before and after) in Redis.

Imports gateway.redis, auth.keys and auth.record only. The trail is one Redis stream, trimmed to about
`auth.audit_max_entries`, so it survives gateway restarts and stays bounded. The key store's scripts append to it in
the same atomic step as the change (`auth.scripts`): an entry holds the record just before and just after, never
the secret or its digest; read back, it shows the fields that changed as `ApiKey` has them (whatever fields exist:
limits, budgets, models, priority...).
"""

from __future__ import annotations

import dataclasses
import functools
import getpass
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

import orjson
import redis.asyncio as redis_asyncio

from gateway.auth.keys import ApiKey
from gateway.auth.record import fields_to_key, text
from gateway.redis import RedisCalls

# The key store's hash tag: the trail lives in the key store's Redis Cluster slot.
AUDIT_STREAM: Final = "nemotron:{keys}:audit"


@dataclass(frozen=True, slots=True)
class AuditEntry:
    """One change to one key: `before` and `after` hold the fields that changed (all of them on create)."""

    at: datetime
    operator: str
    action: str
    name: str
    prefix: str
    before: dict[str, Any]
    after: dict[str, Any]

    def as_json(self) -> dict[str, Any]:
        """The entry as JSON-ready data."""
        return {
            "at": self.at.strftime("%Y-%m-%d %H:%M:%S.%fZ"),
            "operator": self.operator,
            "action": self.action,
            "name": self.name,
            "prefix": self.prefix,
            "before": self.before,
            "after": self.after,
        }


def default_operator() -> str:
    """The OS user running this process (the CLI's operator unless `--operator` names one)."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "unknown"


def key_fields(key: ApiKey | None) -> dict[str, Any]:
    """A key record's fields as JSON-ready values, limits flattened (`limits.daily_tokens`); {} for no key."""
    if key is None:
        return {}
    fields: dict[str, Any] = {}
    for name, value in dataclasses.asdict(key).items():
        if isinstance(value, dict):
            fields.update({f"{name}.{inner}": _plain(item) for inner, item in value.items()})
        else:
            fields[name] = _plain(value)
    return fields


def changes(before: ApiKey | None, after: ApiKey | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The fields that differ between two versions of a key record, as (before, after); all of them when one is
    None (a key created)."""
    old, new = key_fields(before), key_fields(after)
    if before is None or after is None:
        return old, new  # created (or gone): every field
    changed = [name for name in dict.fromkeys([*old, *new]) if old.get(name) != new.get(name)]
    return {name: old[name] for name in changed if name in old}, {name: new[name] for name in changed if name in new}


class KeyAudit:
    """Appends to and reads the audit trail of key changes."""

    def __init__(self, redis: redis_asyncio.Redis, calls: RedisCalls, max_entries: int, operator: str | None) -> None:
        self._redis = redis
        self._calls = calls
        self._max_entries = max_entries
        self.operator = operator or default_operator()

    def script_args(self, action: str) -> list[str | int]:
        """The last ARGV of a key store script that changes a record (`action`: create, set, rotate, revoke, ...):
        the trail's cap, the operator and the action; the script appends the entry itself (`auth.scripts`)."""
        return [self._max_entries, self.operator, action]

    async def note(self, action: str, key: ApiKey, after: dict[str, Any]) -> None:
        """Append an entry for a change that no key store script makes (what was deleted with a key: its stored
        responses), `after` its fields."""
        entry = {
            "at": str(int(datetime.now(UTC).timestamp() * 1_000_000)),
            "operator": self.operator,
            "action": action,
            "name": key.name,
            "prefix": key.prefix,
            "before": "{}",
            "after": orjson.dumps(after).decode(),
        }
        await self._calls(
            lambda: self._redis.xadd(AUDIT_STREAM, entry, maxlen=self._max_entries, approximate=True)  # type: ignore[arg-type]
        )

    async def read(self, name: str | None = None, limit: int = 100) -> list[AuditEntry]:
        """The newest `limit` entries (of key `name`, when given), oldest first."""
        entries: list[AuditEntry] = []
        last = "+"
        while len(entries) < limit:
            batch = await self._calls(functools.partial(self._redis.xrevrange, AUDIT_STREAM, last, "-", 500))
            if not batch:
                break
            for _, raw in batch:
                entry = _entry(raw or {})
                if name is None or entry.name == name:
                    entries.append(entry)
                    if len(entries) >= limit:
                        break
            last = "(" + text(batch[-1][0] or "")
            if len(batch) < 500:
                break
        return entries[::-1]


def _entry(raw: Mapping[bytes | str, bytes | str]) -> AuditEntry:
    fields = {text(field): text(value) for field, value in raw.items()}
    if "before_record" in fields:
        # The records as the change's script read them: the fields that changed are worked out here.
        before, after = changes(_record(fields["before_record"]), _record(fields["after_record"]))
    else:  # an entry from before the scripts wrote the trail: the changed fields themselves
        before, after = orjson.loads(fields.get("before") or "{}"), orjson.loads(fields.get("after") or "{}")
    return AuditEntry(
        at=datetime.fromtimestamp(int(fields["at"]) / 1_000_000, UTC),
        operator=fields.get("operator", ""),
        action=fields.get("action", ""),
        name=fields.get("name", ""),
        prefix=fields.get("prefix", ""),
        before=before,
        after=after,
    )


def _record(encoded: str) -> ApiKey | None:
    """A record as a script encoded it (Lua's cjson: a JSON object, `{}` for none)."""
    fields = orjson.loads(encoded)
    return fields_to_key(fields)[0] if isinstance(fields, dict) and fields else None


def _plain(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")
    if isinstance(value, tuple | list):
        return list(value)
    return value
