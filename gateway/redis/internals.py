"""Every use the Redis boundary makes of redis-py below its documented API, and the redis-py versions it holds for.

Checked with redis-py 8.1.0 and 8.2.0; `pyproject.toml` bounds redis to `REQUIREMENT` (8.1 is the first release
whose asyncio client takes `maint_notifications_config`; 5.x to 7.x lack what the script lane imports, and a new
major may change any of it). `INTERNALS` declares each name relied upon, and tests/unit/test_library_internals.py
checks them against the installed redis-py, so an upgrade that drops or reshapes one fails a test, not a request.
What is relied upon:

- `redis.asyncio.connection.AbstractConnection`, subclassed by `InlineWrite`, which overrides `disconnect` and
  `send_packed_command` (writing to `_writer` itself when the write cannot wait; `health_check_interval` and
  `next_health_check` say whether a PING is due); the script lane calls `connect` and then takes the connection's
  transport from `_writer`, clearing `_reader` and `_writer` when it gives the connection up. The pub/sub listener
  calls `register_connect_callback` and `deregister_connect_callback` on its connection.
- `redis.asyncio.connection.ConnectionPool`: `connection_class` replaced by `InlineWrite`'s derivative,
  `connection_kwargs` read (`socket_timeout`), `make_connection` called, and `_in_use_connections` (the pool's count
  of connections in use) holding the lane's connection, so closing the client closes it.
- `redis.commands.core.AsyncScript`, subclassed by `DirectScript`: `__init__` and `__call__` overridden, `sha` and
  `script` read.
- `redis._parsers.base.BaseParser.parse_error`: an error reply's text to redis-py's exception for it.
- `redis.asyncio.client.PubSub.connection` and `redis.asyncio.sentinel.SentinelConnectionPool.sentinel_manager`.
- The options `connect_redis` gives every connection (`AbstractConnection.__init__`), `maint_notifications_config`
  and `driver_info` among them (redis-py 8.1+), and the pool's `max_connections`.

Imports redis-py and the package's own modules (the subclasses named above) only.
"""

from __future__ import annotations

import re
from typing import Final

from redis._parsers.base import BaseParser
from redis.asyncio.client import PubSub
from redis.asyncio.connection import AbstractConnection, ConnectionPool
from redis.asyncio.sentinel import SentinelConnectionPool
from redis.commands.core import AsyncScript

from gateway.redis.script_lane import DirectScript, InlineWrite
from gateway.types import LibraryInternals

# The redis-py releases the declaration below was checked on: the bound in pyproject.toml, word for word.
REQUIREMENT: Final = "redis>=8.1,<9"
_LOWEST: Final = (8, 1)
_BELOW: Final = (9, 0)
_RELEASE: Final = re.compile(r"(\d+)\.(\d+)")


def supported(version: str) -> bool:
    """Whether redis-py `version` (e.g. `8.2.0`, `8.1.0rc1`) lies within `REQUIREMENT`."""
    release = _RELEASE.match(version)
    return release is not None and _LOWEST <= (int(release[1]), int(release[2])) < _BELOW


INTERNALS: tuple[LibraryInternals, ...] = (
    LibraryInternals(
        AbstractConnection,
        subclass=InlineWrite,
        overridden=("disconnect", "send_packed_command"),
        used=(
            "_writer",
            "_reader",
            "health_check_interval",
            "next_health_check",
            "connect",
            "register_connect_callback",
            "deregister_connect_callback",
        ),
        called=(
            ("send_packed_command", ("command", "check_health")),
            # What `connect_redis` passes for every connection (through the pool's `connection_kwargs`).
            (
                "__init__",
                (
                    "socket_timeout",
                    "socket_connect_timeout",
                    "health_check_interval",
                    "decode_responses",
                    "maint_notifications_config",
                    "driver_info",
                ),
            ),
        ),
    ),
    LibraryInternals(
        ConnectionPool,
        used=("connection_class", "connection_kwargs", "make_connection", "_in_use_connections"),
        called=(("__init__", ("max_connections",)),),
    ),
    LibraryInternals(AsyncScript, subclass=DirectScript, overridden=("__init__", "__call__"), used=("sha", "script")),
    LibraryInternals(BaseParser, used=("parse_error",), called=(("parse_error", ("response",)),)),
    LibraryInternals(PubSub, used=("connection",)),
    LibraryInternals(SentinelConnectionPool, used=("sentinel_manager",)),
)
