"""The `replicas` verb: an operator's view of the pool and hands on it.

- `replicas list`: the gateway's own view (`/ready`'s `replicas`: url, model, ready, drained, reason, in_flight).
- `replicas drain URL|INDEX`, `replicas restore URL|INDEX`: a replica out of, or back into, the pool (Redis, seen by
  every gateway within one probe interval). INDEX is a managed replica of this host (`local_replica_urls()`).
- `replicas restart [INDEX ...]`: a rolling restart of this host's managed replicas, one at a time: drain it, wait
  until the gateway shows none of its requests in flight, ask its supervisor to restart it (a request file in its
  state dir), wait until the gateway shows it ready on a new engine, restore it and wait until the gateway shows it
  back. A replica drained here is restored whatever happens; one the operator had drained before stays drained.

Talks to the gateway over HTTP, to Redis through the drain module, to the supervisors through their state dirs; never
imports them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import redis.asyncio as redis_asyncio

from gateway.engine.supervisor_state import STATUS_FILE, EngineState, pid_alive, read_status, request_restart
from gateway.pool.drain import drain_replica, drained_replicas, restore_replica
from gateway.redis import REDIS_ERRORS, close_redis, connect_redis
from gateway.settings import Settings

# Seconds between two looks at the gateway's /ready and the supervisor's status while a restart waits.
_POLL = 0.5
_READY_TIMEOUT = 5.0


class ReplicaCommandError(Exception):
    """A `replicas` command cannot go on: its message says why, for the operator."""


def add_replicas_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
    common: Callable[[argparse.ArgumentParser], None],
) -> None:
    """Add `replicas` and its verbs to the top-level CLI; `common` adds the shared flags to each verb."""
    replicas = subparsers.add_parser("replicas", help="list, drain, restore and restart engine replicas")
    verbs = replicas.add_subparsers(dest="replicas_verb", required=True, metavar="VERB")
    listing = verbs.add_parser("list", help="the gateway's view of every replica (its /ready)")
    listing.add_argument("--json", action="store_true", help="the replicas as /ready names them, as JSON")
    for name, what in (("drain", "take no new requests"), ("restore", "take requests again")):
        verb = verbs.add_parser(name, help=f"a replica is to {what}")
        verb.add_argument("replica", metavar="URL|INDEX", help="a replica's URL, or the index of one of this host's")
        common(verb)
    restart = verbs.add_parser("restart", help="a rolling restart of this host's managed replicas, one at a time")
    restart.add_argument("indices", metavar="INDEX", type=int, nargs="*", help="the replicas (default: every one)")
    restart.add_argument(
        "--drain-timeout",
        type=float,
        help="seconds a drained replica's requests may take to finish (default: NEMOTRON_SHUTDOWN_GRACE)",
    )
    restart.add_argument(
        "--ready-timeout",
        type=float,
        help="seconds a restarted replica may take to be ready again (default: NEMOTRON_ENGINE__STARTUP_TIMEOUT)",
    )
    for verb in (listing, restart):
        verb.add_argument("--port", type=int, help="the local gateway's port (NEMOTRON_PORT)")
        common(verb)


def run_replicas(args: argparse.Namespace, settings: Settings) -> int:
    """Run one `replicas` verb; 0 when it did what it was asked, 1 when it could not, 2 for a wrong argument."""
    try:
        return asyncio.run(_run(args, settings))
    except ReplicaCommandError as exc:
        sys.stderr.write(f"nemotron-gateway replicas: {exc}\n")
        return 1
    except ValueError as exc:
        sys.stderr.write(f"nemotron-gateway replicas: {exc}\n")
        return 2


async def _run(args: argparse.Namespace, settings: Settings) -> int:
    if args.replicas_verb == "list":
        async with _gateway_client() as client:
            entries = await ready_replicas(client, gateway_ready_url(settings))
        sys.stdout.write(_json_lines(entries) if args.json else _table(entries))
        return 0
    redis = connect_redis(settings)
    try:
        if args.replicas_verb in ("drain", "restore"):
            url = replica_url(settings, args.replica)
            try:
                if args.replicas_verb == "drain":
                    await drain_replica(redis, url)
                    sys.stdout.write(f"{url}: drained (no new requests within one probe interval)\n")
                elif await restore_replica(redis, url):
                    sys.stdout.write(f"{url}: restored\n")
                else:
                    sys.stdout.write(f"{url}: was not drained\n")
            except REDIS_ERRORS as exc:
                raise ReplicaCommandError(f"Redis did not answer ({str(exc) or type(exc).__name__})") from exc
            return 0
        indices = list(args.indices) or list(range(len(settings.local_replica_urls())))
        async with _gateway_client() as client:
            restart = RollingRestart(
                settings,
                redis,
                client,
                drain_timeout=args.drain_timeout if args.drain_timeout is not None else settings.shutdown_grace,
                ready_timeout=(
                    args.ready_timeout if args.ready_timeout is not None else settings.engine.startup_timeout
                ),
            )
            await restart.run(indices)
        return 0
    finally:
        await close_redis(redis)


def _gateway_client() -> httpx.AsyncClient:
    # Straight to 127.0.0.1, whatever proxy the environment names.
    return httpx.AsyncClient(timeout=_READY_TIMEOUT, trust_env=False)


def gateway_ready_url(settings: Settings) -> str:
    """The local gateway's /ready (`--port` sets NEMOTRON_PORT)."""
    return f"http://127.0.0.1:{settings.port}/ready"


def replica_url(settings: Settings, target: str) -> str:
    """A replica's URL from what the operator typed: a URL, or the index of one of this host's managed replicas."""
    if target.isdigit():
        local = settings.local_replica_urls()
        if int(target) >= len(local):
            raise ValueError(f"replica {target} is not one of this host's {len(local)} (0 to {len(local) - 1})")
        return local[int(target)]
    if not target.startswith(("http://", "https://")):
        raise ValueError(f"{target!r} is neither a replica's URL (http://...) nor an index")
    return target.rstrip("/")


async def ready_replicas(client: httpx.AsyncClient, url: str) -> list[dict[str, Any]]:
    """The `replicas` of the gateway's /ready (answered 200 or 503: both say which replicas are ready)."""
    try:
        answer = await client.get(url)
        body = answer.json()
    except httpx.HTTPError as exc:
        raise ReplicaCommandError(f"the gateway's {url} did not answer ({str(exc) or type(exc).__name__})") from exc
    except ValueError as exc:
        raise ReplicaCommandError(f"the gateway's {url} answered {answer.status_code} without JSON") from exc
    entries = body.get("replicas") if isinstance(body, dict) else None
    if not isinstance(entries, list):
        raise ReplicaCommandError(f"the gateway's {url} names no replicas (a gateway without the replica pool?)")
    return [entry for entry in entries if isinstance(entry, dict)]


def _table(entries: Sequence[dict[str, Any]]) -> str:
    rows = [("URL", "MODEL", "READY", "DRAINED", "IN FLIGHT", "REASON")]
    for entry in entries:
        rows.append(
            (
                str(entry.get("url", "?")),
                str(entry.get("model") or "-"),
                "yes" if entry.get("ready") else "no",
                "yes" if entry.get("drained") else "no",
                str(entry.get("in_flight", "?")),
                str(entry.get("reason") or "-"),
            )
        )
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]) - 1)]
    return "".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False)) + f"  {row[-1]}\n"
        for row in rows
    )


def _json_lines(entries: Sequence[dict[str, Any]]) -> str:
    return "".join(f"{json.dumps(entry)}\n" for entry in entries)


@dataclass
class RollingRestart:
    """Restarts this host's managed replicas one at a time, each drained while it restarts. `clock` and `sleep` are
    the waits' (a test gives its own)."""

    settings: Settings
    redis: redis_asyncio.Redis
    client: httpx.AsyncClient
    drain_timeout: float
    ready_timeout: float
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep

    async def run(self, indices: Sequence[int]) -> None:
        """Restart each of `indices` in turn; the first failure stops the rest (ReplicaCommandError)."""
        local = self.settings.local_replica_urls()
        for index in indices:
            if not 0 <= index < len(local):
                raise ValueError(f"replica {index} is not one of this host's {len(local)} (0 to {len(local) - 1})")
        for index in indices:
            await self.restart(index, local[index])

    async def restart(self, index: int, url: str) -> None:
        """Drain replica `index` (at `url`), restart its engine, see it ready again, restore it."""
        state_dir = self.settings.engine.replica_state_dir(index)
        before = read_status(state_dir / STATUS_FILE)
        if before is None or not pid_alive(before.supervisor_pid):
            raise ReplicaCommandError(f"replica {index}: no running supervisor writes {state_dir / STATUS_FILE}")
        drained_before = url in await drained_replicas(self.redis)
        await drain_replica(self.redis, url)
        self._say(f"replica {index} ({url}): drained; waiting for its requests to finish")
        try:
            await self._wait(
                lambda: self._in_flight_zero(url),
                self.drain_timeout,
                f"replica {index}: requests still in flight after {self.drain_timeout:g} s (--drain-timeout)",
            )
            request_restart(state_dir)
            self._say(f"replica {index}: restart requested (engine pid {before.engine_pid})")
            await self._wait(
                lambda: self._restarted(index, url, before.engine_pid),
                self.ready_timeout,
                f"replica {index}: not ready again after {self.ready_timeout:g} s (--ready-timeout)",
            )
        finally:
            if not drained_before:
                await restore_replica(self.redis, url)
        if drained_before:
            self._say(f"replica {index}: ready again (left drained, as it was before)")
            return
        # Back in the pool as the gateway sees it (its workers read drains every few seconds) before the next replica
        # is drained: until then the gateway would count both out, and the command ends with every replica serving.
        await self._wait(
            lambda: self._back(url),
            self.drain_timeout,
            f"replica {index}: restored, but the gateway still shows it drained after {self.drain_timeout:g} s",
        )
        self._say(f"replica {index}: ready again and restored")

    async def _in_flight_zero(self, url: str) -> bool:
        entry = await self._entry(url)
        # Drained as the gateway sees it first (it reads drains every few seconds), then nothing left in flight.
        return entry is not None and entry.get("drained") is True and entry.get("in_flight") == 0

    async def _back(self, url: str) -> bool:
        entry = await self._entry(url)
        return entry is not None and entry.get("drained") is False and entry.get("ready") is True

    async def _restarted(self, index: int, url: str, old_pid: int | None) -> bool:
        """Whether the supervisor runs a new engine, ready, and the gateway sees it ready."""
        status = read_status(self.settings.engine.replica_state_dir(index) / STATUS_FILE)
        if status is None:
            return False
        if status.state == EngineState.FAILED:
            raise ReplicaCommandError(f"replica {index}: its supervisor gave up ({status.reason})")
        if status.state != EngineState.READY or status.engine_pid in (None, old_pid):
            return False
        entry = await self._entry(url)
        return entry is not None and entry.get("ready") is True

    async def _entry(self, url: str) -> dict[str, Any] | None:
        ready_url = gateway_ready_url(self.settings)
        for entry in await ready_replicas(self.client, ready_url):
            if str(entry.get("url", "")).rstrip("/") == url:
                return entry
        raise ReplicaCommandError(f"the gateway's {ready_url} does not name replica {url}")

    async def _wait(self, done: Callable[[], Awaitable[bool]], within: float, failure: str) -> None:
        """Poll `done` until it is true; ReplicaCommandError(`failure`) once `within` s of `clock` have passed."""
        deadline = self.clock() + within
        while not await done():
            if self.clock() >= deadline:
                raise ReplicaCommandError(failure)
            await self.sleep(_POLL)

    @staticmethod
    def _say(line: str) -> None:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
