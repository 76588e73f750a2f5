"""Every knob of the gateway, in one pydantic-settings object (env prefix `NEMOTRON_`).

The only reader of the environment. Imports nothing of ours. Built once per process at the
entry point and passed down; there is no module-level instance.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_SYSTEM_MESSAGE = "You are a helpful assistant."


class _Group(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class RelaySettings(_Group):
    """How the gateway talks to the engine (`NEMOTRON_RELAY__<FIELD>`)."""

    connect_timeout: float = Field(5.0, gt=0, description="Seconds to open a TCP connection to the engine.")
    first_byte_timeout: float = Field(
        600.0,
        gt=0,
        description="Seconds until the engine's response starts. A non-streamed request only answers when the "
        "whole completion is done, so this bounds its total generation time.",
    )
    chunk_timeout: float = Field(
        120.0,
        gt=0,
        description="Seconds a stream may stay silent between two chunks before the gateway ends it with an "
        "error event (a frozen engine otherwise holds the client forever).",
    )
    heartbeat_interval: float = Field(
        15.0,
        gt=0,
        description="Seconds of silence in a stream after which the gateway writes an SSE comment "
        "(`: keep-alive`) so idle-timeout proxies do not cut a long prefill.",
    )
    max_connections: int = Field(1024, ge=1, description="Size of the keep-alive connection pool to the engine.")
    probe_interval: float = Field(2.0, gt=0, description="Seconds between two probes of the engine's /health.")
    probe_timeout: float = Field(2.0, gt=0, description="Seconds one /health probe may take.")
    retry_after: float = Field(
        5.0, gt=0, description="Retry-After (seconds) sent with 503s while the engine is down or starting."
    )


class RedisSettings(_Group):
    """Tight timeouts: no request may hang on Redis (`NEMOTRON_REDIS__<FIELD>`)."""

    connect_timeout: float = Field(0.5, gt=0, description="Seconds to connect to Redis.")
    socket_timeout: float = Field(0.5, gt=0, description="Seconds one Redis command may take.")
    max_connections: int = Field(256, ge=1, description="Size of the Redis connection pool.")


class Settings(BaseSettings):
    """The gateway's configuration: environment variables `NEMOTRON_<FIELD>`, an optional env file, or flags.

    Nested groups use `__`: `NEMOTRON_RELAY__CHUNK_TIMEOUT=60`.
    """

    model_config = SettingsConfigDict(
        env_prefix="NEMOTRON_",
        env_nested_delimiter="__",
        frozen=True,
        extra="forbid",
        env_file=None,
    )

    host: str = Field("127.0.0.1", description="Address the gateway listens on (behind nginx: keep 127.0.0.1).")
    port: int = Field(8000, ge=1, le=65535, description="Port the gateway listens on.")
    engine_url: str = Field(
        "http://127.0.0.1:8001", description="Base URL of the OpenAI-compatible engine (vllm serve) on this machine."
    )
    redis_url: SecretStr = Field(
        SecretStr("redis://127.0.0.1:6379/0"),
        description="Redis holding keys and limit counters (may carry a password, so it is never logged).",
    )
    model_name: str | None = Field(
        None, description="The served model name clients must send; learned from the engine's /v1/models when unset."
    )
    model_aliases: tuple[str, ...] = Field(
        (), description="Other names accepted for the served model (JSON list); rewritten to the served name."
    )
    context_length: int | None = Field(
        None, ge=1, description="Context length of the model; learned from the engine's /v1/models when unset."
    )
    default_system_message: str = Field(
        DEFAULT_SYSTEM_MESSAGE,
        description="System message inserted into chat requests that have none (some Nemotron templates misbehave "
        "without one).",
    )
    inject_system_message: bool = Field(True, description="Whether to insert `default_system_message`.")
    max_body_bytes: int = Field(2 * 1024 * 1024, ge=1024, description="Largest request body accepted (413 above).")
    max_n: int = Field(8, ge=1, le=128, description="Largest `n` (choices per request) accepted.")
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field("info", description="Log level.")
    access_log: bool = Field(True, description="Write one access-log line per request.")

    relay: RelaySettings = Field(default_factory=RelaySettings)
    redis: RedisSettings = Field(default_factory=RedisSettings)

    @field_validator("engine_url")
    @classmethod
    def _strip_trailing_slash(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError("engine_url must start with http:// or https://")
        return value.rstrip("/")

    def masked(self) -> dict[str, Any]:
        """The effective configuration for the start-up log line, secrets masked."""
        return self.model_dump(mode="json")
