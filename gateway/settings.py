"""Every knob of the gateway, in one pydantic-settings object (env prefix `NEMOTRON_`).

The only reader of the environment. Imports nothing of ours. Built once per process at the
entry point and passed down; there is no module-level instance.
"""

from __future__ import annotations

import difflib
import logging
import os
import zoneinfo
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import unquote

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_SYSTEM_MESSAGE = "You are a helpful assistant."
ENV_PREFIX = "NEMOTRON_"
# Variables of the test suite, not of the gateway (tests/conftest.py reads them).
_TEST_PREFIX = "NEMOTRON_TEST_"
SENTINEL_SCHEME = "redis+sentinel"
SENTINEL_PORT = 26379

logger = logging.getLogger(__name__)


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
    keepalive_timeout: float = Field(
        3.0,
        gt=0,
        description="Seconds an idle pooled engine connection is kept; below the engine's own idle timeout "
        "(5 s in vllm serve).",
    )
    probe_interval: float = Field(
        2.0,
        gt=0,
        description="Seconds between two probes of the engine's /health; also how long the engine may be idle (no "
        "chunk or answer from it) before a one-token generation probe checks that it still generates.",
    )
    probe_timeout: float = Field(
        2.0,
        gt=0,
        description="Seconds one /health probe may take. A late answer alone never refuses traffic (a saturated "
        "engine answers /health late); only a refused connection, a non-200 answer or a stuck engine do.",
    )
    retry_after: float = Field(
        5.0, gt=0, description="Retry-After (seconds) sent with 503s while the engine is down or starting."
    )
    generation_probe_timeout: float = Field(
        10.0,
        gt=0,
        description="Seconds the one-token generation probe (POST /v1/completions, max_tokens 1) may take before "
        "it counts as failed. Generous: a CPU engine on two cores is slow, and a failure only matters when no other "
        "progress is seen meanwhile.",
    )
    stall_timeout: float = Field(
        15.0,
        gt=0,
        description="Seconds the engine may hold requests without sending any chunk or answer before it is taken "
        "as stuck (if a generation probe fails too): new requests then get 503 with Retry-After, /ready says "
        "'engine not generating', and requests in flight end with an error. Bound: a frozen engine is refused "
        "within max(stall_timeout, generation_probe_timeout + 2 x probe_interval) + probe_interval seconds "
        "(17 s with the defaults) when busy, and within generation_probe_timeout + 2 x probe_interval (14 s) when "
        "idle; a refused connection or a non-200 /health within probe_interval. Raise it where one prefill may "
        "outlast it (very long prompts on a CPU engine).",
    )


class RedisSettings(_Group):
    """Tight timeouts: no request may hang on Redis (`NEMOTRON_REDIS__<FIELD>`)."""

    connect_timeout: float = Field(0.5, gt=0, description="Seconds to connect to Redis.")
    socket_timeout: float = Field(0.5, gt=0, description="Seconds one Redis command may take.")
    max_connections: int = Field(256, ge=1, description="Size of the Redis connection pool.")
    command_timeout: float = Field(
        1.0,
        gt=0,
        description="Seconds one Redis operation of the gateway (key lookup, admission, release, guard count) may "
        "take in all, its one retry on a fresh connection after a connection error included; past it the "
        "request gets 503 (or is admitted, where `fail_open` says so). The single deadline of every Redis call.",
    )
    sentinel_password: SecretStr | None = Field(
        None,
        description="Password of the Sentinels themselves (`requirepass` in sentinel.conf), with a "
        "`redis+sentinel://` URL; the URL's own password is the master's.",
    )


class AuthSettings(_Group):
    """API keys: how they are hashed, cached, and guarded against guessing (`NEMOTRON_AUTH__<FIELD>`)."""

    enabled: bool = Field(
        True,
        description="Require an API key (and apply its limits) on the /v1 routes. Off only for local development "
        "and overhead benchmarks.",
    )

    secret: SecretStr | None = Field(
        None,
        description="Server secret for HMAC-SHA256 of API keys in Redis. Unset: plain SHA-256 (a warning is logged "
        "at start). Changing it invalidates every existing key.",
    )
    cache_ttl: float = Field(
        1.0,
        gt=0,
        le=1.0,
        description="Seconds a key looked up in Redis is trusted from the in-process cache. Revocations also arrive "
        "by pub/sub; this bound holds if that is lost, so it may not exceed 1 s.",
    )
    cache_size: int = Field(10_000, ge=1, description="Most keys kept in the in-process cache of each gateway process.")
    fail_open: bool = Field(
        False,
        description="While Redis is down, keep admitting keys this process authenticated within "
        "`fail_open_max_age` seconds (default: fail closed, 503 for everyone).",
    )
    fail_open_max_age: float = Field(
        300.0, gt=0, description="Seconds a cached key stays usable for `fail_open` after its last Redis lookup."
    )
    failed_auth_limit: int = Field(
        20,
        ge=1,
        description="Failed authentications from one client address within `failed_auth_window` that block it.",
    )
    failed_auth_window: float = Field(60.0, gt=0, description="Seconds over which failed authentications are counted.")
    failed_auth_block: float = Field(
        300.0, gt=0, description="Seconds a blocked client address is answered 429 without its key being checked."
    )
    audit_max_entries: int = Field(
        100_000,
        ge=100,
        description="Most entries kept in the audit trail of key changes (a Redis stream, trimmed approximately).",
    )


class RateLimitSettings(_Group):
    """Per-key limits, held across every gateway process sharing Redis (`NEMOTRON_LIMITS__<FIELD>`).

    A key's own limits override these defaults; 0 on a key means unlimited.
    """

    requests_per_minute: int | None = Field(
        60, ge=1, description="Default requests per minute for keys without their own limit (unset: unlimited)."
    )
    tokens_per_minute: int | None = Field(
        100_000,
        ge=1,
        description="Default tokens (prompt + completion) per minute for keys without their own limit "
        "(unset: unlimited).",
    )
    max_concurrency: int | None = Field(
        8, ge=1, description="Default requests in flight per key (streams count until they end; unset: unlimited)."
    )
    window: float = Field(60.0, gt=0, description="Seconds the per-minute limits refer to; only tests change it.")
    lease_ttl: float = Field(
        30.0,
        gt=0,
        description="Seconds a concurrency slot lives unless renewed; a crashed gateway's slots free themselves "
        "after it.",
    )
    lease_renew_interval: float = Field(
        10.0, gt=0, description="Seconds between renewals of this process's live slots; must be below `lease_ttl`."
    )
    fail_open: bool = Field(
        False,
        description="While Redis is down, admit requests without limits or token budgets, uncharged (default: fail "
        "closed, 503).",
    )
    overlap_admission: bool = Field(
        False,
        description="Send a request of a key this process admitted last time on to the engine while Redis checks its "
        "limits, one request of a key at a time: the admission's round trip leaves the latency (about 0.07 ms at "
        "c=1). A refusal then aborts the request at the engine and the client gets only the 429, so the engine may "
        "see one refused request per key and gateway process each time the key runs out. Off: the engine sees a "
        "request only once it is admitted.",
    )
    usage_retention_days: int = Field(
        400,
        ge=1,
        description="Days the per-key daily usage counters (requests and tokens by API and model, for billing) are "
        "kept in Redis.",
    )
    # Token budgets (per key, daily and monthly): their windows and what a key without its own budget gets.
    budget_timezone: str = Field(
        "UTC",
        description="IANA time zone whose midnights start the daily and monthly token budget windows (e.g. "
        "`Europe/Berlin`); usage for billing is always by UTC day.",
    )
    daily_tokens: int | None = Field(
        None, ge=1, description="Default daily token budget for keys without their own (unset: unlimited)."
    )
    monthly_tokens: int | None = Field(
        None, ge=1, description="Default monthly token budget for keys without their own (unset: unlimited)."
    )

    @field_validator("budget_timezone")
    @classmethod
    def _known_timezone(cls, value: str) -> str:
        try:
            zoneinfo.ZoneInfo(value)
        except (zoneinfo.ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"unknown time zone {value!r}: use an IANA name such as UTC or Europe/Berlin") from None
        return value

    default_priority: int = Field(
        0,
        ge=0,
        description="Scheduling priority of keys without their own (vLLM's meaning: lower is served sooner).",
    )

    @model_validator(mode="after")
    def _renew_before_expiry(self) -> RateLimitSettings:
        if self.lease_renew_interval >= self.lease_ttl:
            raise ValueError("lease_renew_interval must be below lease_ttl")
        return self


class AdmissionSettings(_Group):
    """Admission before vLLM's queue (`NEMOTRON_ADMISSION__<FIELD>`), held across every gateway sharing Redis.

    The engine's gauges are read from vLLM's /metrics at each probe of the engine (`relay.probe_interval`).
    A request of priority p is refused once the engine's waiting requests (its last scrape plus what gateways
    admitted since) reach `max_waiting` x share(p), where share(p) is `shares[min(p, len(shares) - 1)]`; the
    most urgent tier (priority 0) is admitted up to the full bound. A tier's bound is at least 1.

    vLLM lets a waiting request take a sequence slot only when a running one ends (it preempts for KV-cache
    blocks, not for slots), so `reserved_seqs` keeps slots free for priority 0: a request of any lower priority
    is refused once the engine holds (runs or queues) `sequence_slots - reserved_seqs` requests.
    """

    max_waiting: int | None = Field(
        None,
        ge=1,
        description="Bound on vLLM's waiting requests beyond which new work is refused (429); unset: off.",
    )
    max_kv_cache_use: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Bound on vLLM's KV-cache use (0-1, times the tier's share) beyond which new work is refused "
        "(503: the engine itself is full); unset: off.",
    )
    shares: tuple[float, ...] = Field(
        (1.0, 0.5, 0.25),
        min_length=1,
        description="Share of the bounds each priority gets (JSON list: priority 0, 1, ...; the last for the rest).",
    )
    reserved_seqs: int | None = Field(
        None,
        ge=1,
        description="Sequence slots kept free for priority 0: lower priorities are refused (429) once the engine "
        "holds sequence_slots minus this many requests; unset: off.",
    )
    sequence_slots: int | None = Field(
        None,
        ge=1,
        description="Sequences the engine runs at once, for reserved_seqs (default: the --max-num-seqs times "
        "--data-parallel-size the supervisor launched it with, read from its status file).",
    )
    max_retry_after: float = Field(
        30.0, ge=1, description="Longest Retry-After a refusal sends (it is derived from the observed drain rate)."
    )
    engine_id: str | None = Field(
        None,
        description="Names the engine's queue in Redis; gateways on several hosts fronting one engine set the same "
        "(default: this host and engine_url).",
    )

    @field_validator("shares")
    @classmethod
    def _shares_in_range(cls, value: tuple[float, ...]) -> tuple[float, ...]:
        if any(not 0 < share <= 1 for share in value):
            raise ValueError("every share must be above 0 and at most 1")
        return value

    @property
    def enabled(self) -> bool:
        """Whether any bound is set (else no scrape, no Redis work)."""
        return self.max_waiting is not None or self.max_kv_cache_use is not None or self.reserved_seqs is not None


class EngineSettings(_Group):
    """The engine the supervisor runs: `vllm serve` on 127.0.0.1 (`NEMOTRON_ENGINE__<FIELD>`)."""

    model: str | None = Field(None, description="Model directory or hub id passed to `vllm serve`.")
    served_model_name: str = Field("nemotron", description="The model name clients send (vLLM's --served-model-name).")
    port: int = Field(8001, ge=1, le=65535, description="Port of the engine on 127.0.0.1 (never exposed).")
    profile: str = Field("balanced", description="Engine profile (see `nemotron-gateway engine profiles`).")
    preset: str = Field(
        "generic",
        description="Model preset (see `nemotron-gateway engine presets`): the model's parsers, chat template, "
        "context length and reasoning switch; combines with the profile. The gateway reads its reasoning switch.",
    )
    profiles_file: Path | None = Field(None, description="The operator's TOML file of extra or changed profiles.")
    extra_args: tuple[str, ...] = Field((), description="Further `vllm serve` flags (JSON list), after the profile's.")
    gpus: str | None = Field(
        None,
        description="The GPUs the engine uses, as a CUDA_VISIBLE_DEVICES value: indices as nvidia-smi numbers them "
        "(PCI bus order) or UUIDs, e.g. `0,1`. Unset: what the supervisor inherits. The gateway's GPU metrics cover "
        "these GPUs only.",
    )
    tensor_parallel_size: int | None = Field(
        None, ge=1, description="vLLM's --tensor-parallel-size, over the profile's and preset's (unset: theirs, or 1)."
    )
    data_parallel_size: int | None = Field(
        None,
        ge=1,
        description="vLLM's --data-parallel-size: that many copies of the model in one `vllm serve`, which balances "
        "requests between them (unset: the profile's or preset's, or 1).",
    )
    python: str | None = Field(None, description="Python interpreter that has vLLM (default: the gateway's own).")
    launcher: tuple[str, ...] | None = Field(
        None,
        description="argv prefix of a `vllm serve`-compatible command (JSON list), replacing "
        "`<python> -m vllm.entrypoints.cli.main serve`; its flags are not checked against vLLM's.",
    )
    startup_timeout: float = Field(
        1800.0, gt=0, description="Seconds the engine may take to answer /health 200 (loading a model takes minutes)."
    )
    health_interval: float = Field(
        5.0,
        gt=0,
        description="Seconds between two liveness checks of a ready engine: its /metrics token counter, and a "
        "one-token generation when it is idle. Formerly `probe_interval` (still accepted, with a warning).",
    )
    probe_timeout: float = Field(
        5.0, gt=0, description="Seconds one /health probe may take while the engine starts (then: `stall_timeout`)."
    )
    probe_failures: int = Field(
        3,
        ge=1,
        description="Consecutive checks answered with an error or a refused connection after which the engine is "
        "restarted.",
    )
    stall_timeout: float = Field(
        15.0,
        gt=0,
        description="Seconds a ready engine may go without evidence that it generates (its token counter grows, or "
        "the idle one-token probe is answered) before it is restarted: a frozen engine is restarted within "
        "stall_timeout + health_interval. A busy engine whose /health answers late is not restarted while tokens "
        "flow.",
    )
    backoff_initial: float = Field(2.0, gt=0, description="Seconds before the first restart after a crash.")
    backoff_max: float = Field(60.0, gt=0, description="Longest wait between restarts (doubling, with jitter).")
    crash_limit: int = Field(5, ge=1, description="Crashes within `crash_window` after which the supervisor gives up.")
    crash_window: float = Field(600.0, gt=0, description="Seconds over which crashes are counted.")
    stop_grace: float = Field(15.0, gt=0, description="Seconds between SIGTERM and SIGKILL of the engine's group.")
    state_dir: Path = Field(
        Path("/tmp/nemotron-gateway"), description="Where the supervisor writes its status file and flag cache."
    )
    metrics_port: int = Field(
        9101, ge=0, le=65535, description="Port on 127.0.0.1 for the supervisor's Prometheus metrics (0: off)."
    )
    log_lines: int = Field(200, ge=10, description="Engine output lines kept to show when start-up fails.")
    replicas: int = Field(
        1,
        ge=1,
        le=64,
        description="Managed engine replicas on this host, each a `vllm serve` of the same model with its own GPUs "
        "(one tensor-parallel group each), port (`port` + its index), status and restarts; the gateway routes "
        "across them.",
    )
    replica: int | None = Field(
        None,
        ge=0,
        description="Run only this replica (its index, from 0): one systemd instance per replica "
        "(`nemotron-engine@<index>`). Unset: the supervisor runs every one of `replicas`.",
    )
    run_doctor: bool = Field(
        True, description="Run the fatal preflight checks before spawning the engine (vLLM's verdict beside its start)."
    )

    def replica_port(self, index: int) -> int:
        """The port of managed replica `index` on 127.0.0.1."""
        return self.port + index

    def replica_state_dir(self, index: int) -> Path:
        """Where managed replica `index`'s supervisor writes its status: `state_dir` for the first, a folder of its
        own inside it for the others."""
        return self.state_dir if index == 0 else self.state_dir / f"replica-{index}"

    @model_validator(mode="after")
    def _replica_in_range(self) -> EngineSettings:
        if self.replica is not None and self.replica >= self.replicas:
            raise ValueError(
                f"replica {self.replica} is not one of the {self.replicas} replicas (0 to {self.replicas - 1})"
            )
        return self

    @model_validator(mode="before")
    @classmethod
    def _renamed_probe_interval(cls, data: Any) -> Any:
        # `probe_interval` also names the relay's /health poll; the engine's is `health_interval` now, so that one
        # name does not mean two intervals (an old `engine.probe_interval` is read as `health_interval`).
        if isinstance(data, dict) and "probe_interval" in data:
            data = dict(data)
            value = data.pop("probe_interval")
            logger.warning("NEMOTRON_ENGINE__PROBE_INTERVAL is deprecated: use NEMOTRON_ENGINE__HEALTH_INTERVAL")
            data.setdefault("health_interval", value)
        return data

    @model_validator(mode="before")
    @classmethod
    def _engine_store_retired(cls, data: Any) -> Any:
        # The engine's own Responses store is always off now (the gateway keeps that state in Redis): its switch and
        # the owners' TTL are read and ignored, so that a unit file that still sets them starts.
        if isinstance(data, dict) and ({"responses_store", "responses_store_ttl"} & data.keys()):
            data = {k: v for k, v in data.items() if k not in ("responses_store", "responses_store_ttl")}
            logger.warning(
                "NEMOTRON_ENGINE__RESPONSES_STORE(_TTL) is ignored: the gateway keeps the Responses API's state "
                "(NEMOTRON_RESPONSES__*)"
            )
        return data


class ResponsesSettings(_Group):
    """The Responses API's stored state, kept by the gateway in Redis (`NEMOTRON_RESPONSES__<FIELD>`): the engine is
    always called with its own store off."""

    store_ttl: float = Field(
        30 * 86400.0,
        gt=0,
        description="Seconds a stored response (its input and output items, usage, status; a background response's "
        "events) is kept after it was made; then it is gone, as if deleted.",
    )
    max_per_key: int = Field(
        10_000,
        ge=1,
        description="Most stored responses one key keeps; storing one more evicts that key's oldest first.",
    )
    max_bytes_per_key: int = Field(
        64 * 1024 * 1024,
        ge=1024,
        description="Most bytes of stored responses one key keeps; storing more evicts that key's oldest first (a "
        "single response larger than this is not kept at all).",
    )
    max_chain: int = Field(
        100,
        ge=1,
        description="Most responses a `previous_response_id` chain may hold (the continued one and those before "
        "it); a longer chain is refused with a 400: send the conversation in `input` instead.",
    )


class HttpSettings(_Group):
    """What one client may cost the gateway's HTTP server before it is cut off (`NEMOTRON_HTTP__<FIELD>`)."""

    max_head_bytes: int = Field(
        16 * 1024,
        ge=1024,
        description="Largest request line plus headers accepted; a longer head is answered 431 and the connection "
        "closed before it is buffered further (an unbounded head costs seconds of CPU for everyone).",
    )
    head_timeout: float = Field(
        10.0,
        gt=0,
        description="Seconds a client has to send a whole request head, counted from the connection's start or from "
        "its request's first byte; a slower one (slowloris) gets 408 and is closed. The idle time between two "
        "requests of a kept-alive connection is uvicorn's keep-alive timeout (5 s), unchanged.",
    )
    body_chunk_timeout: float = Field(
        10.0,
        gt=0,
        description="Seconds a request body may stall between two chunks before the request is answered 408.",
    )
    body_timeout: float = Field(
        30.0,
        gt=0,
        description="Seconds a whole request body may take to arrive (from the end of its head) before it is "
        "answered 408; the connection is closed if the body is still arriving a second later.",
    )
    max_connections: int | None = Field(
        None,
        ge=1,
        description="Most client connections held at once; a connection beyond it is answered 503 at once and "
        "closed, with a rate-limited warning. Unset: the process's open-file limit (RLIMIT_NOFILE) less room for "
        "the engine and Redis pools and logs, at least half of it, so a flood cannot take the last file descriptor.",
    )


class MetricsSettings(_Group):
    """`NEMOTRON_METRICS__*`: what /metrics and /metrics/engine export, and to whom."""

    per_key: bool = Field(
        True,
        description="Label per-key series (tokens, requests, rejections) with the key's name; turn off for "
        "deployments with many keys. A revoked key's series stop being exported.",
    )
    allowed_networks: str = Field(
        "127.0.0.0/8,::1/128",
        description="Comma-separated networks (CIDR) whose scrapes of /metrics and /metrics/engine are answered "
        "without a token; others get 403 unless they send `metrics.token`.",
    )
    token: SecretStr | None = Field(
        None,
        description="Bearer token that opens /metrics and /metrics/engine from any address (Prometheus's "
        "`authorization` in its scrape config).",
    )
    engine: bool = Field(
        True, description="Relay the engine's own Prometheus metrics (vLLM's `vllm:*`) at /metrics/engine."
    )
    engine_timeout: float = Field(5.0, gt=0, description="Seconds the engine's /metrics may take for one scrape.")


class RoutingSettings(_Group):
    """How a request is given to one replica of its model (`NEMOTRON_ROUTING__<FIELD>`).

    `affinity` sends the turns of one conversation (the same key and leading messages, the same stored-response
    chain, or the same session header) to the replica whose prefix cache holds them, by rendezvous hashing, and
    spills to the least loaded replica when that one is past `spill_load`; `least_loaded` sends each request to the
    replica with the least outstanding work; `round_robin` takes them in turn (a baseline for benchmarks).
    """

    picker: Literal["affinity", "least_loaded", "round_robin"] = Field(
        "affinity", description="The picker of every model not named in `pickers`."
    )
    pickers: dict[str, Literal["affinity", "least_loaded", "round_robin"]] = Field(
        default_factory=dict, description='A picker per served model name (JSON object: {"nemotron-super": ...}).'
    )
    spill_load: float = Field(
        2.0,
        ge=1,
        description="Affinity spills a request to the least loaded replica when the preferred one's outstanding "
        "requests exceed this many times the least loaded one's (plus `spill_slack`).",
    )
    spill_slack: int = Field(
        4, ge=0, description="Outstanding requests the preferred replica may carry beyond the least loaded one's."
    )
    prefix_chars: int = Field(
        2048,
        ge=64,
        description="Bytes of each of a conversation's leading parts (its system prompt or instructions, and its "
        "first turn) that its affinity is hashed from: conversations that agree that far share a replica, and its "
        "prefix cache.",
    )
    session_header: str = Field(
        "X-Session-Id",
        min_length=1,
        description="A request header naming a session: requests of one key with the same value go to one replica.",
    )
    failover: bool = Field(
        True,
        description="Try a request once on another replica of its model when its replica refuses or resets the "
        "connection, or answers that its queue is full, before the first byte reaches the client.",
    )
    file_poll_interval: float = Field(
        2.0,
        gt=0,
        description="Seconds between two looks at `replicas_file` for a change; the drains (kept in Redis) are read "
        "every third look.",
    )
    remote_scheduling: Literal["fcfs", "priority"] = Field(
        "fcfs",
        description="The scheduling policy of the replicas given by URL (`replicas`, `replicas_file`), whose launch "
        "this host's supervisor does not see: `priority` when they run vLLM with `--scheduling-policy priority` (a "
        "`-priority` profile), so that keys' priorities travel to them; under `fcfs` none is sent (vLLM refuses it). "
        "A managed replica's policy is read from its supervisor's status.",
    )


class TracingSettings(_Group):
    """OpenTelemetry tracing (`NEMOTRON_TRACING__<FIELD>`): what the standard `OTEL_*` variables do not say.

    Tracing is on when `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or `OTEL_EXPORTER_OTLP_ENDPOINT` names a collector (and
    neither `OTEL_SDK_DISABLED=true` nor `OTEL_TRACES_EXPORTER=none` turns it off); the protocol, headers, sampler,
    service name and batching are the standard variables' (see [Tracing](operations/tracing.md)).
    """

    capture_content: bool = Field(
        False,
        description="Put the prompt and the completion text on the request's span (`gen_ai.input.messages`, "
        "`gen_ai.output.messages`). Off: no text a client sent or the model wrote is ever exported.",
    )
    engine: bool = Field(
        True,
        description="Start vLLM with its own tracing pointed at the same collector, so that its spans of a request "
        "nest under the gateway's; only the requests the gateway samples are traced there.",
    )
    engine_service_name: str = Field(
        "vllm", min_length=1, description="`service.name` of the engine's spans (the gateway's is `OTEL_SERVICE_NAME`)."
    )


class Settings(BaseSettings):
    """The gateway's configuration: environment variables `NEMOTRON_<FIELD>`, an optional env file, or flags.

    Nested groups use `__`: `NEMOTRON_RELAY__CHUNK_TIMEOUT=60`.
    """

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        frozen=True,
        extra="forbid",
        env_file=None,
        # A bad value is named, never echoed: the Redis URL and the secrets may carry passwords.
        hide_input_in_errors=True,
    )

    host: str = Field("127.0.0.1", description="Address the gateway listens on (behind nginx: keep 127.0.0.1).")
    port: int = Field(8000, ge=1, le=65535, description="Port the gateway listens on.")
    engine_url: str = Field(
        "http://127.0.0.1:8001", description="Base URL of the OpenAI-compatible engine (vllm serve) on this machine."
    )
    replicas: tuple[str, ...] = Field(
        (),
        description="Further engine replicas by URL (JSON list), e.g. other GPU machines that run only the engine side "
        "(`nemotron-engine`); each serves the model its /v1/models names.",
    )
    replicas_file: Path | None = Field(
        None,
        description="A file of further replicas, one URL a line (`#` comments), watched: a replica added or removed "
        "there joins or leaves the pool within `routing.file_poll_interval` seconds, without a restart.",
    )
    engine_api_key: SecretStr | None = Field(
        None, description="Bearer token the gateway sends to the engine when vllm serve runs with --api-key."
    )
    redis_url: SecretStr = Field(
        SecretStr("redis://127.0.0.1:6379/0"),
        description="Redis holding keys and limit counters (may carry a password, so it is never logged): "
        "`redis://[:password@]host:6379/0`, `rediss://` for TLS, or Sentinel's "
        "`redis+sentinel://[:password@]host1:26379,host2:26379,host3:26379/mymaster/0` (the master's name, "
        "then the db), whose master is asked of the Sentinels and followed through a failover.",
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
    max_messages: int = Field(
        2048,
        ge=1,
        description="Most chat messages (or prompts in a batch) one request may carry; checked before the costly "
        'per-message checks: on the raw body (its "role" keys) before it is even parsed, and exactly after.',
    )
    max_list_entries: int = Field(
        8192,
        ge=1,
        description="Most entries the other lists one request carries may hold together (content parts, tool "
        "calls, tools, stop strings, logit_bias entries); checked before the costly per-entry checks: on the raw "
        'body (its "type" keys, which JSON-schema nodes inside tools also have) before it is parsed, and exactly '
        "after.",
    )
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field("info", description="Log level.")
    access_log: bool = Field(True, description="Write one access-log line per request.")
    log_probes: bool = Field(
        False,
        description="Also access-log /health and /ready (a load balancer's or `make run`'s probes, several a "
        "second); they are counted in the metrics either way.",
    )
    log_format: Literal["text", "json"] = Field(
        "text",
        description="Access-log format: `text` (one human line) or `json` (one JSON object per request, for a log "
        "shipper); neither ever holds a key or, by default, the prompt.",
    )
    shutdown_grace: float = Field(
        30.0, ge=0, description="Seconds a stopping gateway lets open requests and streams finish before closing them."
    )
    trusted_proxies: str = Field(
        "127.0.0.1",
        description="Comma-separated addresses (or *) whose X-Forwarded-For is believed for the client address "
        "(nginx on this machine); a forwarded value that is not an IPv4 or IPv6 address is ignored.",
    )
    workers: int | None = Field(
        None,
        ge=1,
        description="Gateway processes serving the one port (`serve --workers`); keys and limits hold across them "
        "(they live in Redis), a worker that dies is replaced. Unset: one per CPU this process may use.",
    )

    relay: RelaySettings = Field(default_factory=RelaySettings)
    redis: RedisSettings = Field(default_factory=RedisSettings)
    auth: AuthSettings = Field(default_factory=AuthSettings)
    limits: RateLimitSettings = Field(default_factory=RateLimitSettings)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    http: HttpSettings = Field(default_factory=HttpSettings)
    metrics: MetricsSettings = Field(default_factory=MetricsSettings)
    admission: AdmissionSettings = Field(default_factory=AdmissionSettings)
    responses: ResponsesSettings = Field(default_factory=ResponsesSettings)
    tracing: TracingSettings = Field(default_factory=TracingSettings)
    routing: RoutingSettings = Field(default_factory=RoutingSettings)

    @field_validator("redis_url")
    @classmethod
    def _check_redis_url(cls, value: SecretStr) -> SecretStr:
        parse_redis_url(value.get_secret_value())  # a ValueError that never quotes the password
        return value

    @field_validator("engine_url")
    @classmethod
    def _strip_trailing_slash(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError("engine_url must start with http:// or https://")
        return value.rstrip("/")

    @field_validator("replicas")
    @classmethod
    def _check_replica_urls(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for url in value:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"replica URL {url!r} must start with http:// or https://")
        return tuple(url.rstrip("/") for url in value)

    def local_replica_urls(self) -> tuple[str, ...]:
        """The engines of this host: `engine_url`, or with several managed replicas each one's 127.0.0.1 URL."""
        if self.engine.replicas == 1:
            return (self.engine_url,)
        return tuple(f"http://127.0.0.1:{self.engine.replica_port(i)}" for i in range(self.engine.replicas))

    def masked(self) -> dict[str, Any]:
        """The effective configuration for the start-up log line, secrets masked."""
        return self.model_dump(mode="json")


@dataclass(frozen=True, slots=True)
class SentinelAddress:
    """Where a `redis+sentinel://` URL says Redis is: the Sentinels to ask, the master's name, the db and the
    master's credentials (the password is a secret: its repr is masked)."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: SecretStr | None = None


def parse_redis_url(url: str) -> SentinelAddress | None:
    """The Sentinel address of a `redis+sentinel://` URL; None for any other URL (redis-py reads those).

    `redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/service[/db]`, the password and user
    percent-encoded, IPv6 hosts in brackets, the port 26379 when left out. A ValueError says what is wrong
    without quoting the password.
    """
    scheme, separator, rest = url.partition("://")
    if not separator or scheme.lower() != SENTINEL_SCHEME:
        return None
    netloc, _, path = rest.partition("/")
    if "?" in path or "#" in path or "?" in netloc:
        raise ValueError(
            "a redis+sentinel:// URL takes no query or fragment (the Sentinels' password is "
            "NEMOTRON_REDIS__SENTINEL_PASSWORD)"
        )
    credentials, at, hosts = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = credentials.partition(":")
        username = unquote(user) or None
        password = SecretStr(unquote(secret)) if colon and secret else None
    sentinels = tuple(_sentinel_host(entry) for entry in hosts.split(","))
    parts = path.split("/") if path else []
    if not parts or not parts[0]:
        raise ValueError("a redis+sentinel:// URL names the master after the hosts: .../mymaster/0")
    if len(parts) > 2 or (len(parts) == 2 and not parts[1].isdigit()):
        raise ValueError("a redis+sentinel:// URL ends with /<master name>[/<db number>]")
    db = int(parts[1]) if len(parts) == 2 else 0
    return SentinelAddress(sentinels, unquote(parts[0]), db, username, password)


def _sentinel_host(entry: str) -> tuple[str, int]:
    if entry.startswith("["):
        host, bracket, port_text = entry[1:].partition("]")
        if not bracket or (port_text and not port_text.startswith(":")):
            raise ValueError("a redis+sentinel:// IPv6 host is written [address]:port")
        port_text = port_text[1:]
    else:
        host, _, port_text = entry.partition(":")
    if not host:
        raise ValueError("a redis+sentinel:// URL lists its Sentinels as host:port,host:port (one is empty)")
    if not port_text:
        return host, SENTINEL_PORT
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise ValueError(f"a redis+sentinel:// URL has a bad port for Sentinel {host}: {port_text!r}")
    return host, int(port_text)


def masked_redis_url(url: str) -> str:
    """The Redis URL with any password replaced by *** (for logs, the doctor and error messages)."""
    scheme, separator, rest = url.partition("://")
    netloc, slash, path = rest.partition("/")
    credentials, at, hosts = netloc.rpartition("@")
    if not separator or not at or ":" not in credentials:
        return url
    user = credentials.partition(":")[0]
    return f"{scheme}://{user}:***@{hosts}{slash}{path}"


def setting_names() -> list[str]:
    """Every environment variable that is a setting: `NEMOTRON_<FIELD>` and `NEMOTRON_<GROUP>__<FIELD>`."""
    names = []
    for name, info in Settings.model_fields.items():
        group = info.annotation
        if isinstance(group, type) and issubclass(group, BaseModel):
            names += [f"{ENV_PREFIX}{name}__{sub}".upper() for sub in group.model_fields]
        else:
            names.append(f"{ENV_PREFIX}{name}".upper())
    return names


def unknown_variables(env_file: Path | None = None) -> list[str]:
    """One warning per `NEMOTRON_*` name in the environment or `env_file` that is no setting, naming the closest.

    pydantic-settings ignores such names in the environment, so a typo (`NEMOTRON_REDIS_ULR`) silently
    leaves the default in force; said once at start instead.
    """
    known = set(setting_names()) | {f"{ENV_PREFIX}ENGINE__PROBE_INTERVAL"}
    found = [(name, "environment") for name in os.environ]
    if env_file is not None:
        found += [(name, str(env_file)) for name in _env_file_names(env_file)]
    warnings = []
    for name, where in found:
        upper = name.upper()
        if not upper.startswith(ENV_PREFIX) or upper.startswith(_TEST_PREFIX) or upper in known:
            continue
        close = difflib.get_close_matches(upper, sorted(known), n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]}?" if close else ""
        warnings.append(f"{name} (in the {where}) is not a setting{hint}")
    return warnings


# sd_listen_fds(3): the first socket systemd passes is fd 3.
_SD_LISTEN_FDS_START = 3


def inherited_listen_fd() -> int | None:
    """The listening socket systemd passed this process (socket activation, sd_listen_fds(3)), else None.

    Only when LISTEN_PID names this very process: a child that inherited the variables must not take it.
    """
    try:
        pid, count = int(os.environ.get("LISTEN_PID", "")), int(os.environ.get("LISTEN_FDS", ""))
    except ValueError:
        return None
    return _SD_LISTEN_FDS_START if pid == os.getpid() and count >= 1 else None


# Where the gateway's worker processes share their metrics: prometheus_client's multiprocess mode, which reads
# the variable when it is first imported, so it is set before the serving modules are (each scrape then reports
# every worker's series).
METRICS_DIR_VARIABLE = "PROMETHEUS_MULTIPROC_DIR"


# The standard OpenTelemetry variables start with this; they are read here, not as settings (gateway/tracing/otlp.py).
OTEL_PREFIX = "OTEL_"


def otel_variables() -> dict[str, str]:
    """The standard `OTEL_*` variables of this process's environment (tracing's switch and its collector)."""
    return {name: value for name, value in os.environ.items() if name.startswith(OTEL_PREFIX)}


def metrics_dir() -> Path | None:
    """The directory the gateway's worker processes write their metrics to, when several serve one port."""
    value = os.environ.get(METRICS_DIR_VARIABLE)
    return Path(value) if value else None


def share_metrics(directory: Path | None) -> None:
    """Make the processes started from here on (and this one, before it imports prometheus_client) write their
    metrics under `directory` for one scrape to sum; None: each process keeps its own again."""
    if directory is None:
        os.environ.pop(METRICS_DIR_VARIABLE, None)
    else:
        os.environ[METRICS_DIR_VARIABLE] = str(directory)


def _env_file_names(path: Path) -> list[str]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    names = []
    for line in lines:
        line = line.strip().removeprefix("export ").strip()
        if line and not line.startswith("#") and "=" in line:
            names.append(line.split("=", 1)[0].strip())
    return names
