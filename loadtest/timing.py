"""One request, timed from the client's side: TTFT, the gaps between streamed tokens, latency, usage, outcome.

A token event is an SSE chunk with a choice: a completions `text`, or a chat `delta` (content, reasoning or
tool calls, possibly empty text); the role-only first chunk, an empty final `delta: {}` and the usage-only
last chunk are not. Output tokens come from the final usage chunk (`stream_options.include_usage`), else
the count of token events.
Imports nothing from `gateway`.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

OK = "ok"
_DATA = b"data:"
_DONE = b"[DONE]"
_DELTA_FIELDS = ("content", "reasoning_content", "reasoning", "tool_calls")


@dataclass(slots=True)
class RequestTiming:
    """What one request measured; times in seconds, `sent_at` from the start of its phase."""

    index: int
    sent_at: float
    scheduled_at: float
    outcome: str = OK  # "ok", an HTTP status ("429"), or timeout|connection|protocol|stream_error|incomplete
    status: int = 0  # 0: no HTTP answer
    latency: float = 0.0
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None
    usage_reported: bool = False
    detail: str | None = None

    @property
    def ok(self) -> bool:
        """Answered 200 and complete."""
        return self.outcome == OK

    @property
    def itl_mean(self) -> float | None:
        """Mean gap between two token events of this stream."""
        return sum(self.gaps) / len(self.gaps) if self.gaps else None

    @property
    def itl_p99(self) -> float | None:
        """The 99th percentile (nearest rank) of this stream's gaps."""
        return percentile(self.gaps, 0.99) if self.gaps else None

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (latency - TTFT) / (output tokens - 1)."""
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    def as_json(self) -> dict[str, Any]:
        """The per-request entry of results.json (milliseconds)."""
        return {
            "index": self.index,
            "sent_at_s": round(self.sent_at, 6),
            "lag_ms": _ms(self.sent_at - self.scheduled_at),
            "outcome": self.outcome,
            "status": self.status,
            "latency_ms": _ms(self.latency),
            "ttft_ms": _ms(self.ttft),
            "itl_mean_ms": _ms(self.itl_mean),
            "itl_p99_ms": _ms(self.itl_p99),
            "output_tokens": self.output_tokens,
            "prompt_tokens": self.prompt_tokens,
            "token_events": len(self.gaps) + (self.ttft is not None),
        }


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank quantile; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


async def timed_request(
    http: aiohttp.ClientSession, url: str, body: bytes, *, stream: bool, record: RequestTiming
) -> RequestTiming:
    """POST `body` and fill `record`; never raises for what the server or the network did."""
    started = time.perf_counter()
    try:
        async with http.post(url, data=body) as answer:
            record.status = answer.status
            if answer.status != 200:
                record.outcome = str(answer.status)
                record.detail = (await answer.content.read(300)).decode("utf-8", "replace")
            elif stream:
                await _read_stream(answer, started, record)
            else:
                _read_json(await answer.read(), record)
    except TimeoutError:
        record.outcome, record.detail = "timeout", "no complete answer within the request timeout"
    except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.IncompleteReadError) as exc:
        record.outcome, record.detail = "connection", f"{type(exc).__name__}: {exc}"
    except (aiohttp.ClientError, ValueError) as exc:
        record.outcome, record.detail = "protocol", f"{type(exc).__name__}: {exc}"
    record.latency = time.perf_counter() - started
    return record


async def _read_stream(answer: aiohttp.ClientResponse, started: float, record: RequestTiming) -> None:
    last = 0.0
    events = 0
    done = False
    async for line in answer.content:
        if not line.startswith(_DATA):
            continue
        payload = line[len(_DATA) :].strip()
        if payload == _DONE:
            # Read on to the end of the body: leaving early closes the connection, which the server may count
            # as a client disconnect (the gateway's 499) while it still writes the last chunk.
            done = True
            continue
        chunk = orjson.loads(payload)
        if not isinstance(chunk, dict):
            raise ValueError("an SSE event that is not a JSON object")
        if "error" in chunk:
            record.outcome, record.detail = "stream_error", str(chunk["error"])[:300]
            return
        _take_usage(chunk.get("usage"), record)
        if _has_tokens(chunk.get("choices")):
            now = time.perf_counter()
            if events == 0:
                record.ttft = now - started
            else:
                record.gaps.append(now - last)
            last = now
            events += 1
    if not done:
        record.outcome, record.detail = "incomplete", "the stream ended without [DONE]"
    if not record.usage_reported:
        record.output_tokens = events


def _read_json(data: bytes, record: RequestTiming) -> None:
    answer = orjson.loads(data)
    if not isinstance(answer, dict) or not answer.get("choices"):
        record.outcome, record.detail = "protocol", "a 200 answer without choices"
        return
    _take_usage(answer.get("usage"), record)


def _take_usage(usage: Any, record: RequestTiming) -> None:
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        record.output_tokens = usage["completion_tokens"]
        prompt = usage.get("prompt_tokens")
        record.prompt_tokens = prompt if isinstance(prompt, int) else None
        record.usage_reported = True


def _has_tokens(choices: Any) -> bool:
    """Whether a chunk carries generated tokens: a completions choice, or a chat delta other than the role
    announcement. Text may be empty: vLLM sends a chunk per step even when a token's text is held back
    (an incomplete UTF-8 sequence, a special token), and that chunk still marks when the token came."""
    if not isinstance(choices, list):
        return False
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        if "text" in choice:
            return True
        delta = choice.get("delta")
        if not isinstance(delta, dict) or not delta:
            continue
        if "role" not in delta or any(delta.get(name) for name in _DELTA_FIELDS):
            return True
    return False
