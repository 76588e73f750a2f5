"""The `nemotron-gateway keys ...` verbs: create, list, show, revoke, rotate and set API keys in Redis; read their
usage by day and API (`usage`) and the trail of changes to them (`audit`). Deleting a key deletes the Responses API
state it stored (`gateway.responses`); `show` and `usage` say how much it keeps.

Talks to Redis directly with the server's settings. A new secret is printed alone on the last line of
stdout (for scripts: `| tail -n1`) and nowhere else. Exit codes: 0 done, 1 failed, 2 bad usage.
Reads usage through `gateway.usage`, the counters the rate limiter writes when requests end (never through
`gateway.ratelimit`: a `keys` verb loads no limiter).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import io
import re
import sys
from collections.abc import Callable, Sequence
from datetime import UTC, date, datetime, timedelta
from typing import Any

import orjson

from gateway.auth.keys import ApiKey, KeyExistsError, KeyLimits, KeyNotFoundError, KeyRevokedError
from gateway.auth.store import KeyStore
from gateway.errors import GatewayError, InvalidRequestError, KeyStoreUnavailableError
from gateway.redis import close_redis, connect_redis
from gateway.responses import ResponseStore
from gateway.settings import Settings
from gateway.usage import Usage, UsageReader

_DURATION_PART = re.compile(r"(\d+)([smhdw])")
_DURATION = re.compile(r"(?:\d+[smhdw])+")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86_400, "w": 604_800}
_ALL_MODELS = "*"
_LIMIT_FLAGS = (
    ("rpm", "requests_per_minute", "requests per minute"),
    ("tpm", "tokens_per_minute", "tokens (prompt + completion) per minute"),
    ("max_concurrency", "max_concurrency", "requests in flight at once"),
)
# Token budgets: flag, KeyLimits field, window (limits.budget_timezone), BudgetUsage field.
_BUDGET_FLAGS = (
    ("daily_tokens", "daily_tokens", "day", "day"),
    ("monthly_tokens", "monthly_tokens", "month", "month"),
)
_USAGE_FIELDS = ("requests", "tokens", "prompt_tokens", "completion_tokens", "reasoning_tokens")


def parse_duration(text: str) -> timedelta:
    """`30d`, `12h`, `90m`, `45s`, `2w` or combinations such as `1d12h`; ValueError otherwise."""
    value = text.strip().lower()
    if not _DURATION.fullmatch(value):
        raise ValueError(f"invalid duration {text!r}: use e.g. 30d, 12h, 90m, 45s or 1d12h")
    seconds = sum(int(amount) * _UNITS[unit] for amount, unit in _DURATION_PART.findall(value))
    if seconds <= 0:
        raise ValueError(f"invalid duration {text!r}: must be longer than zero")
    return timedelta(seconds=seconds)


def add_keys_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
    common: Callable[[argparse.ArgumentParser], None] | None = None,
) -> None:
    """Add `keys` and its verbs to the top-level CLI; `common` adds the shared flags to each verb."""
    keys = subparsers.add_parser("keys", help="Manage API keys (stored in Redis).", description=__doc__)
    verbs = keys.add_subparsers(dest="keys_verb", required=True, metavar="VERB")

    create = verbs.add_parser("create", help="Create a key; prints its secret on the last line.")
    create.add_argument("--name", required=True, help="Unique name: letters, digits, '.', '_', '-'.")
    _add_limit_flags(create)
    _add_budget_flags(create)
    create.add_argument("--expires-in", type=_duration_arg, metavar="DURATION", help="e.g. 30d, 12h, 90m.")
    create.add_argument("--models", type=_models_arg, metavar="M,...", help="Models the key may use (default all).")
    _add_priority_flag(create)

    listing = verbs.add_parser("list", help="List keys.")
    listing.add_argument("--json", action="store_true", help="JSON instead of a table.")

    show = verbs.add_parser("show", help="Show one key and its usage today.")
    show.add_argument("name")
    show.add_argument("--json", action="store_true", help="JSON instead of text.")

    revoke = verbs.add_parser("revoke", help="Revoke a key for good (within a second, on every gateway).")
    revoke.add_argument("name")

    delete = verbs.add_parser("delete", help="Delete a key's record (it stops working; the audit trail keeps it).")
    delete.add_argument("name")

    rotate = verbs.add_parser("rotate", help="Replace a key's secret; prints the new one on the last line.")
    rotate.add_argument("name")

    update = verbs.add_parser("set", help="Change a key's limits, models or disabled flag.")
    update.add_argument("name")
    _add_limit_flags(update, allow_default=True)
    _add_budget_flags(update, allow_default=True)
    update.add_argument(
        "--force", action="store_true", help="Set a token budget even below what the key used this window."
    )
    update.add_argument(
        "--models", type=_models_arg, default=argparse.SUPPRESS, metavar="M,...", help="Models ('*': all)."
    )
    _add_priority_flag(update, allow_default=True)
    enabled = update.add_mutually_exclusive_group()
    enabled.add_argument("--disable", dest="disabled", action="store_true", default=None, help="Disable the key.")
    enabled.add_argument("--enable", dest="disabled", action="store_false", help="Enable it again.")
    usage = verbs.add_parser("usage", help="Requests and tokens by key, UTC day, API and model (for billing).")
    usage.add_argument("name", nargs="?", help="One key (default: every key).")
    usage.add_argument("--since", type=_date_arg, metavar="YYYY-MM-DD", help="First UTC day (default: 30 days ago).")
    usage_format = usage.add_mutually_exclusive_group()
    usage_format.add_argument("--json", action="store_true", help="JSON instead of a table.")
    usage_format.add_argument("--csv", action="store_true", help="CSV instead of a table.")

    audit = verbs.add_parser("audit", help="The trail of changes to keys: who changed what, and when.")
    audit.add_argument("name", nargs="?", help="One key (default: every key).")
    audit.add_argument("--limit", type=_positive_arg, default=100, metavar="N", help="Newest N entries (100).")
    audit.add_argument("--json", action="store_true", help="JSON instead of text.")
    for changing in (create, revoke, delete, rotate, update):
        changing.add_argument(
            "--operator", metavar="NAME", help="Who makes the change, for the audit trail (default: the OS user)."
        )
    if common is not None:
        for verb in (create, listing, show, revoke, delete, rotate, update, usage, audit):
            common(verb)


def run_keys(args: argparse.Namespace, settings: Settings) -> int:
    """Run the `keys` verb in `args`; returns the exit code."""
    try:
        return asyncio.run(_run(args, settings))
    except KeyStoreUnavailableError:
        _fail("Redis is unreachable; check NEMOTRON_REDIS_URL and that Redis is running.")
        return 1
    except (KeyExistsError, KeyNotFoundError, KeyRevokedError) as exc:
        _fail(exc.message)
        return 1
    except InvalidRequestError as exc:
        _fail(exc.message)
        return 2
    except GatewayError as exc:
        _fail(exc.message)
        return 1


async def _run(args: argparse.Namespace, settings: Settings) -> int:
    redis = connect_redis(settings)
    try:
        store = KeyStore(redis, settings, operator=getattr(args, "operator", None))
        reader = UsageReader(redis, settings)
        verb: str = args.keys_verb
        if verb == "create":
            await _create(store, args)
        elif verb == "list":
            await _list(store, reader, settings, as_json=args.json)
        elif verb == "show":
            await _show(store, reader, ResponseStore(redis, settings), settings, args.name, as_json=args.json)
        elif verb == "revoke":
            await store.revoke(args.name)
            _out(f"Revoked API key '{args.name}'; it stops working on every gateway within a second.")
        elif verb == "delete":
            await _delete(store, ResponseStore(redis, settings), args.name)
        elif verb == "rotate":
            secret = await store.rotate(args.name)
            _out(f"Rotated API key '{args.name}'; the old secret no longer works. New secret (shown once):")
            _out(secret)
        elif verb == "set":
            await _set(store, reader, args)
        elif verb == "usage":
            await _usage(store, reader, ResponseStore(redis, settings), args)
        elif verb == "audit":
            await _audit(store, args)
        else:
            raise InvalidRequestError(f"unknown verb {verb!r}")
    finally:
        await close_redis(redis)
    return 0


async def _delete(store: KeyStore, responses: ResponseStore, name: str) -> None:
    """Delete the key's record, then every response it stored (the audit trail names how many, when any)."""
    key = await store.get(name)
    await store.delete(name)
    deleted = await responses.delete_owner(key.key_id)
    if deleted:
        await store.audit.note("delete-responses", key, {"stored_responses_deleted": deleted})
    _out(
        f"Deleted API key '{name}' and its {deleted} stored response(s); it stops working on every gateway within "
        "a second."
    )


async def _create(store: KeyStore, args: argparse.Namespace) -> None:
    expires_in: timedelta | None = args.expires_in
    key, secret = await store.create(
        args.name,
        KeyLimits(
            requests_per_minute=getattr(args, "rpm", None),
            tokens_per_minute=getattr(args, "tpm", None),
            max_concurrency=getattr(args, "max_concurrency", None),
            daily_tokens=getattr(args, "daily_tokens", None),
            monthly_tokens=getattr(args, "monthly_tokens", None),
        ),
        expires_at=datetime.now(UTC) + expires_in if expires_in is not None else None,
        models=None if args.models in (None, [_ALL_MODELS]) else args.models,
        priority=getattr(args, "priority", None),
    )
    _out(f"Created API key '{key.name}' ({key.prefix}...). Store the secret now; it cannot be shown again:")
    _out(secret)


async def _set(store: KeyStore, reader: UsageReader, args: argparse.Namespace) -> None:
    changes_limits = any(hasattr(args, flag) for flag, _, _ in _LIMIT_FLAGS)
    changes_limits = changes_limits or any(hasattr(args, flag) for flag, _, _, _ in _BUDGET_FLAGS)
    models: list[str] | None = getattr(args, "models", None)
    changes_priority = hasattr(args, "priority")
    if not changes_limits and models is None and args.disabled is None and not changes_priority:
        raise InvalidRequestError(
            "nothing to change: give --rpm, --tpm, --max-concurrency, --daily-tokens, --monthly-tokens, --models, "
            "--priority or --disable"
        )
    limits = None
    if changes_limits:
        own = (await store.get(args.name)).limits
        limits = KeyLimits(
            requests_per_minute=getattr(args, "rpm", own.requests_per_minute),
            tokens_per_minute=getattr(args, "tpm", own.tokens_per_minute),
            max_concurrency=getattr(args, "max_concurrency", own.max_concurrency),
            daily_tokens=getattr(args, "daily_tokens", own.daily_tokens),
            monthly_tokens=getattr(args, "monthly_tokens", own.monthly_tokens),
        )
        if not args.force:
            await _check_budgets_above_use(reader, args)
    if limits is not None or models is not None:
        everything = models == [_ALL_MODELS]
        await store.set_limits(args.name, limits, None if everything else models, all_models=everything)
    if changes_priority:
        await store.set_priority(args.name, args.priority)
    if args.disabled is not None:
        await store.set_disabled(args.name, args.disabled)
    _out(f"Updated API key '{args.name}'; every gateway applies it within a second.")


async def _list(store: KeyStore, reader: UsageReader, settings: Settings, *, as_json: bool) -> None:
    keys = await store.list()
    usage = await reader.usage([key.name for key in keys])
    rows = [_describe(key, usage[key.name], settings) for key in keys]
    if as_json:
        _out(orjson.dumps(rows, option=orjson.OPT_INDENT_2).decode())
        return
    header = ["NAME", "PREFIX", "RPM", "TPM", "CONCURRENCY", "STATE", "CREATED", "LAST USED"]
    table = [header]
    for row in rows:
        table.append(
            [
                row["name"],
                row["prefix"],
                _limit_cell(row, "requests_per_minute"),
                _limit_cell(row, "tokens_per_minute"),
                _limit_cell(row, "max_concurrency"),
                row["state"],
                row["created_at"],
                row["last_used"] or "never",
            ]
        )
    widths = [max(len(line[column]) for line in table) for column in range(len(header))]
    for line in table:
        _out("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip())
    if any("*" in cell for row in table[1:] for cell in row[2:5]):
        _out("* server default (NEMOTRON_LIMITS__*)")


async def _show(
    store: KeyStore, reader: UsageReader, responses: ResponseStore, settings: Settings, name: str, *, as_json: bool
) -> None:
    key = await store.get(name)
    row = _describe(key, (await reader.usage([key.name]))[key.name], settings)
    budget = await reader.budget_usage(key.name)
    row["budget_used"] = {"day": budget.day, "month": budget.month}
    stored = await responses.usage(key.key_id)
    row["stored_responses"] = {"responses": stored.responses, "bytes": stored.bytes}
    if as_json:
        _out(orjson.dumps(row, option=orjson.OPT_INDENT_2).decode())
        return
    for label, value in (
        ("name", row["name"]),
        ("prefix", row["prefix"]),
        ("state", row["state"]),
        ("created", row["created_at"]),
        ("expires", row["expires_at"] or "never"),
        ("requests/min", _limit_cell(row, "requests_per_minute")),
        ("tokens/min", _limit_cell(row, "tokens_per_minute")),
        ("max concurrency", _limit_cell(row, "max_concurrency")),
        ("tokens/day", f"{_limit_cell(row, 'daily_tokens')} (used {budget.day})"),
        ("tokens/month", f"{_limit_cell(row, 'monthly_tokens')} (used {budget.month})"),
        ("models", ", ".join(row["models"]) if row["models"] is not None else "all"),
        ("priority", str(row["priority"])),
        ("requests today", str(row["usage_today"]["requests"])),
        ("tokens today", str(row["usage_today"]["tokens"])),
        ("stored", f"{stored.responses} responses, {stored.bytes} bytes"),
        ("last used", row["last_used"] or "never"),
    ):
        _out(f"{label + ':':<17}{value}")
    if any(value is None for value in row["own_limits"].values()):
        _out("* server default (NEMOTRON_LIMITS__*)")


async def _check_budgets_above_use(reader: UsageReader, args: argparse.Namespace) -> None:
    """InvalidRequestError when a new budget is below what the key already used in its current window."""
    used = await reader.budget_usage(args.name)
    for flag, _, window, field in _BUDGET_FLAGS:
        budget: int | None = getattr(args, flag, None)
        spent: int = getattr(used, field)
        if budget and budget < spent:
            raise InvalidRequestError(
                f"--{flag.replace('_', '-')} {budget} is below the {spent} tokens '{args.name}' already used this "
                f"{window}; the key would be refused until the {window} ends. Give --force to set it anyway."
            )


async def _usage(store: KeyStore, reader: UsageReader, responses: ResponseStore, args: argparse.Namespace) -> None:
    keys = [await store.get(args.name)] if args.name else await store.list()
    names = [key.name for key in keys]
    today = datetime.now(UTC).date()
    since: date = args.since or today - timedelta(days=30)
    if since > today:
        raise InvalidRequestError(f"--since {since.isoformat()} is in the future (today is {today.isoformat()}, UTC)")
    rows = [
        {
            "key": row.name,
            "day": row.day.isoformat(),
            "api": row.api,
            "model": row.model,
            **{f: getattr(row, f) for f in _USAGE_FIELDS},
        }
        for row in await reader.usage_by_api(names, since)
    ]
    if args.json:
        _out(orjson.dumps(rows, option=orjson.OPT_INDENT_2).decode())
        return
    header = ["key", "day", "api", "model", *_USAGE_FIELDS]
    if args.csv:
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow(header)
        writer.writerows([row[column] for column in header] for row in rows)
        sys.stdout.write(buffer.getvalue())
        return
    _table([[column.upper() for column in header], *([str(row[column]) for column in header] for row in rows)])
    if not rows:
        _out(f"no usage since {since.isoformat()} (UTC)")
    for key in keys:
        stored = await responses.usage(key.key_id)
        if stored.responses:
            _out(f"{key.name} keeps {stored.responses} stored responses ({stored.bytes} bytes)")


async def _audit(store: KeyStore, args: argparse.Namespace) -> None:
    entries = [entry.as_json() for entry in await store.audit.read(args.name, args.limit)]
    if args.json:
        _out(orjson.dumps(entries, option=orjson.OPT_INDENT_2).decode())
        return
    for entry in entries:
        changed = ", ".join(
            f"{field}: {_audit_value(entry['before'], field)} -> {_audit_value(entry['after'], field)}"
            for field in dict.fromkeys([*entry["before"], *entry["after"]])
        )
        who = f"{entry['at']}  {entry['operator']}  {entry['action']}"
        _out(f"{who}  {entry['name']} ({entry['prefix']}...)  {changed}")
    if not entries:
        _out("no changes recorded" + (f" for '{args.name}'" if args.name else ""))


def _audit_value(fields: dict[str, Any], field: str) -> str:
    return orjson.dumps(fields[field]).decode() if field in fields else "-"


def _table(table: list[list[str]]) -> None:
    widths = [max(len(line[column]) for line in table) for column in range(len(table[0]))]
    for line in table:
        _out("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip())


def _describe(key: ApiKey, usage: Usage, settings: Settings) -> dict[str, Any]:
    """The key and its usage as JSON-ready data; `limits` are effective (null: unlimited), `own_limits` as set."""
    defaults = settings.limits
    own = key.limits
    return {
        "name": key.name,
        "prefix": key.prefix,
        "state": key.state(datetime.now(UTC)).value,
        "created_at": _when(key.created_at),
        "expires_at": _when(key.expires_at) if key.expires_at else None,
        "limits": {
            "requests_per_minute": _effective(own.requests_per_minute, defaults.requests_per_minute),
            "tokens_per_minute": _effective(own.tokens_per_minute, defaults.tokens_per_minute),
            "max_concurrency": _effective(own.max_concurrency, defaults.max_concurrency),
            "daily_tokens": _effective(own.daily_tokens, defaults.daily_tokens),
            "monthly_tokens": _effective(own.monthly_tokens, defaults.monthly_tokens),
        },
        "own_limits": {
            "requests_per_minute": own.requests_per_minute,
            "tokens_per_minute": own.tokens_per_minute,
            "max_concurrency": own.max_concurrency,
            "daily_tokens": own.daily_tokens,
            "monthly_tokens": own.monthly_tokens,
        },
        "models": list(key.models) if key.models is not None else None,
        "priority": settings.limits.default_priority if key.priority is None else key.priority,
        "usage_today": {"day": usage.day.isoformat(), "requests": usage.requests, "tokens": usage.tokens},
        "last_used": _when(usage.last_used) if usage.last_used else None,
    }


def _effective(own: int | None, default: int | None) -> int | None:
    value = default if own is None else own
    return value or None


def _limit_cell(row: dict[str, Any], field: str) -> str:
    value = row["limits"][field]
    text = "unlimited" if value is None else str(value)
    return text + "*" if row["own_limits"][field] is None else text


def _when(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def _add_number_flag(parser: argparse.ArgumentParser, flag: str, help_text: str) -> None:
    """One `--flag N` of a key's numbers (a limit or a budget): absent from the namespace unless given."""
    name = f"--{flag.replace('_', '-')}"
    parser.add_argument(name, dest=flag, type=_limit_arg, default=argparse.SUPPRESS, metavar="N", help=help_text)


def _add_limit_flags(parser: argparse.ArgumentParser, *, allow_default: bool = False) -> None:
    for flag, _, meaning in _LIMIT_FLAGS:
        extra = "; 'default': the server default" if allow_default else ""
        omitted = "unchanged" if allow_default else "default"
        _add_number_flag(parser, flag, f"Limit on {meaning} (0: unlimited{extra}; omitted: {omitted}).")


def _add_priority_flag(parser: argparse.ArgumentParser, *, allow_default: bool = False) -> None:
    extra = "; 'default': the server default; omitted: unchanged" if allow_default else "; omitted: the default"
    parser.add_argument(
        "--priority",
        type=_priority_arg,
        default=argparse.SUPPRESS,
        metavar="N",
        help=f"Scheduling priority, 0 or more (lower is served sooner and refused last when the GPU is full{extra}).",
    )


def _priority_arg(text: str) -> int | None:
    return _number_or_default(text, "a priority is 0 (most urgent) or more")


def _limit_arg(text: str) -> int | None:
    return _number_or_default(text, "limits are 0 (unlimited) or more")


def _number_or_default(text: str, negative: str) -> int | None:
    """A whole number of 0 or more (`negative` says why not), or None for 'default'."""
    if text.strip().lower() == "default":
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number or 'default', got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(negative)
    return value


def _add_budget_flags(parser: argparse.ArgumentParser, *, allow_default: bool = False) -> None:
    for flag, _, window, _ in _BUDGET_FLAGS:
        extra = "; 'default': the server default" if allow_default else ""
        _add_number_flag(
            parser, flag, f"Token budget per {window} (NEMOTRON_LIMITS__BUDGET_TIMEZONE; 0: unlimited{extra})."
        )


def _date_arg(text: str) -> date:
    try:
        return date.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a date as YYYY-MM-DD, got {text!r}") from None


def _positive_arg(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number above 0, got {text!r}")
    return int(text)


def _duration_arg(text: str) -> timedelta:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _models_arg(text: str) -> list[str]:
    models = [model.strip() for model in text.split(",") if model.strip()]
    if not models:
        raise argparse.ArgumentTypeError("name at least one model, or '*' for all")
    return models


def _out(line: str) -> None:
    sys.stdout.write(line + "\n")


def _fail(message: str) -> None:
    sys.stderr.write(f"error: {message}\n")


def main(argv: Sequence[str] | None = None, settings: Settings | None = None) -> int:
    """`python -m gateway.auth.cli keys ...`, for use before the top-level CLI wires these verbs in."""
    parser = argparse.ArgumentParser(prog="nemotron-gateway")
    add_keys_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return run_keys(args, settings or Settings())


if __name__ == "__main__":
    sys.exit(main())
