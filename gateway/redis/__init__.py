"""The one Redis boundary: the client factory, the error map to KeyStoreUnavailableError, the pub/sub listener and the
fenced script lane (the redis-py internals it relies on are declared in `gateway.redis.internals`).

Every gateway module that talks to Redis imports it from here; only this package imports redis-py's connection,
parser and script internals.
"""

from gateway.redis.client import (
    REDIS_ERRORS,
    UNAVAILABLE,
    PubSubListener,
    RedisCalls,
    close_redis,
    connect_redis,
    ping_redis,
)
from gateway.redis.script_lane import INCOMPLETE, DirectScript, ScriptLane, pack_command, reply_reader, script_lane

__all__ = [
    "INCOMPLETE",
    "REDIS_ERRORS",
    "UNAVAILABLE",
    "DirectScript",
    "PubSubListener",
    "RedisCalls",
    "ScriptLane",
    "close_redis",
    "connect_redis",
    "pack_command",
    "ping_redis",
    "reply_reader",
    "script_lane",
]
