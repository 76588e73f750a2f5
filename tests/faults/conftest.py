"""The fault tier's shared parts: a key made by the real `keys` CLI, SSE streams read as a client sees them,
the leak checks (concurrency slots in Redis, the gateway's in-flight gauge), and the figures it measures.

Processes come from tests/procs.py; this module adds no process harness of its own. Each measured figure
is printed as `fault figure: NAME = VALUE UNIT` and, with NEMOTRON_FAULT_FIGURES=PATH, merged into that
JSON file (the README's reliability section quotes them).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from tests.procs import REPO_ROOT, FakeEngineControl, ServerProcess, run_fake_engine, run_gateway

MODEL = "nemotron"
PEPPER = "fault-tier-pepper"
# The gateway's settings every fault test shares: keys on (with this HMAC secret) and a quick engine probe.
GATEWAY_ENV = {"NEMOTRON_AUTH__SECRET": PEPPER, "NEMOTRON_RELAY__PROBE_INTERVAL": "0.2"}
FIGURES_ENV = "NEMOTRON_FAULT_FIGURES"
_IN_FLIGHT_RE = re.compile(r"^nemotron_gateway_requests_in_flight ([0-9.e+-]+)$", re.M)


def create_key(redis_url: str, name: str, max_concurrency: int = 100, *flags: str, rpm: int = 0, tpm: int = 0) -> str:
    """A key with `max_concurrency` slots (and no rate limits unless given; further `keys create` flags), made by
    `nemotron-gateway keys create`."""
    argv = [sys.executable, "-m", "gateway", "keys", "create", "--name", name, "--rpm", str(rpm), "--tpm", str(tpm)]
    argv += ["--max-concurrency", str(max_concurrency), "--redis-url", redis_url, *flags]
    done = subprocess.run(
        argv,
        cwd=REPO_ROOT,
        env={**os.environ, "NEMOTRON_AUTH__SECRET": PEPPER},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


def lease_count(redis_url: str, key_name: str) -> int:
    """Concurrency slots the key holds in Redis right now (the limiter's lease set)."""
    client = redis.Redis.from_url(redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
    try:
        return int(client.zcard(f"nemotron:rl:{{{key_name}}}:lease"))
    finally:
        client.close()


def in_flight(gateway_url: str) -> float:
    """The gateway's `nemotron_gateway_requests_in_flight` gauge (the scrape itself may count in it)."""
    text = httpx.get(f"{gateway_url}/metrics", timeout=5.0).text
    found = _IN_FLIGHT_RE.search(text)
    assert found is not None, "no in-flight gauge in /metrics"
    return float(found.group(1))


def in_flight_settled(gateway_url: str, baseline: float) -> bool:
    """The gauge is back to `baseline` in several scrapes, each on a new connection, so every worker answers."""
    return all(in_flight(gateway_url) <= baseline for _ in range(8))


def chat_body(*, stream: bool = True, max_tokens: int = 2000, token_delay: float = 0.02) -> dict[str, Any]:
    """A chat request the fake engine answers with `max_tokens` tokens, `token_delay` seconds apart."""
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "stream": stream,
        "max_tokens": max_tokens,
        "fake_token_delay": token_delay,
    }


@dataclass
class StreamOutcome:
    """What one streaming client saw: status, each `data:` payload, and when the stream ended."""

    status: int = 0
    data: list[str] = field(default_factory=list)
    ended_at: float = 0.0
    transport_error: str | None = None

    @property
    def done(self) -> bool:
        return "[DONE]" in self.data

    @property
    def errors(self) -> list[dict[str, Any]]:
        """The SSE error events (OpenAI's envelope) the stream carried."""
        found = []
        for payload in self.data:
            if payload.startswith("{") and '"error"' in payload:
                event = json.loads(payload)
                if isinstance(event.get("error"), dict):
                    found.append(event["error"])
        return found

    @property
    def tokens(self) -> int:
        return sum(1 for payload in self.data if payload.startswith("{") and '"error"' not in payload)


async def read_stream(
    client: httpx.AsyncClient,
    url: str,
    headers: dict[str, str],
    body: dict[str, Any],
    started: asyncio.Event | None = None,
) -> StreamOutcome:
    """POST a streaming request and read it to its end; `started` is set at the first token."""
    outcome = StreamOutcome()
    buffer = ""
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            outcome.status = response.status_code
            async for text in response.aiter_text():
                buffer += text
                *events, buffer = buffer.split("\n\n")
                for event in events:
                    outcome.data += [line[6:] for line in event.splitlines() if line.startswith("data: ")]
                if started is not None and outcome.tokens > 0:
                    started.set()
    except httpx.TransportError as exc:
        # A cut without an error event: what the fault tier exists to rule out.
        outcome.transport_error = f"{type(exc).__name__}: {exc}"
    outcome.ended_at = time.monotonic()
    if started is not None:
        started.set()
    return outcome


def assert_ended_with_one_error(outcome: StreamOutcome, what: str) -> None:
    """The stream was cut by a fault: one SSE error event, last, and no [DONE]; never a silent cut.

    The connection may close uncleanly after the error event (the SDK raises on the event itself).
    """
    assert outcome.status == 200, f"{what}: status {outcome.status}"
    assert outcome.errors, f"{what}: no error event (transport: {outcome.transport_error}): {outcome.data[-2:]}"
    assert not outcome.done, f"{what}: [DONE] after a fault"
    assert len(outcome.errors) == 1, f"{what}: {len(outcome.errors)} error events: {outcome.data[-3:]}"
    assert outcome.data[-1].startswith("{") and '"error"' in outcome.data[-1], f"{what}: the error is not last"


@dataclass
class Figures:
    """Measured figures of this run, printed and (with NEMOTRON_FAULT_FIGURES) merged into a JSON file."""

    values: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __call__(self, name: str, value: float, unit: str, note: str = "") -> None:
        self.values[name] = {"value": round(value, 3), "unit": unit, "note": note}
        sys.stdout.write(f"\nfault figure: {name} = {value:.3f} {unit} {note}\n")


@pytest.fixture(scope="session")
def figures() -> Iterator[Figures]:
    collected = Figures()
    yield collected
    target = os.environ.get(FIGURES_ENV)
    if target and collected.values:
        path = Path(target)
        previous = json.loads(path.read_text()) if path.is_file() else {}
        path.write_text(json.dumps({**previous, **collected.values}, indent=2, sort_keys=True) + "\n")


@dataclass
class Gateway:
    """A `nemotron-gateway serve` process in front of a fake engine, with one key of its own."""

    proc: ServerProcess
    url: str
    engine: FakeEngineControl
    redis_url: str
    key_name: str
    headers: dict[str, str]

    def leases(self) -> int:
        return lease_count(self.redis_url, self.key_name)


@contextlib.contextmanager
def gateway_on(
    engine: FakeEngineControl, redis_url: str, *, max_concurrency: int = 100, **env: str
) -> Iterator[Gateway]:
    """`nemotron-gateway serve` in front of `engine`, with a fresh key; stopped when the block ends."""
    name = f"fault-{uuid.uuid4().hex[:10]}"
    secret = create_key(redis_url, name, max_concurrency)
    with run_gateway(engine.base_url, redis_url, env={**GATEWAY_ENV, **env}) as proc:
        headers = {"Authorization": f"Bearer {secret}"}
        yield Gateway(proc, f"http://127.0.0.1:{proc.port}", engine, redis_url, name, headers)


@pytest.fixture(scope="module")
def fault_engine() -> Iterator[FakeEngineControl]:
    """One fake engine per module, serving the model name the supervisor's engine would."""
    with run_fake_engine(model=MODEL) as process:
        yield FakeEngineControl(process)
