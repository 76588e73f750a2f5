"""`systemctl restart nemotron-gateway` under load, run INSIDE the deploy container.

Non-streamed requests in closed loops and streams in flight, directly and through nginx; once every loop
has been answered and every stream has its first token, the gateway is restarted; the loops go on until
requests sent after the restart are answered. Prints one JSON object: every failure, each request's
latency around the restart, each stream's ending. Standalone (httpx only): it runs on the installed venv.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

LOOPS_PER_TARGET = 3
# Seconds between one loop's request starts, per target: nginx's site limits an address to 20 requests/s.
PACE = {"direct": 0.0, "nginx": 0.25}
# Streams that finish within the grace (~2 s) and streams that cannot (~100 s).
SHORT_STREAM = {"max_tokens": 20, "fake_token_delay": 0.1}
LONG_STREAM = {"max_tokens": 1000, "fake_token_delay": 0.1}
# How long the loops keep going once requests sent after the restart are answered.
AFTER = 2.0


@dataclass
class Request:
    target: str
    started: float
    latency: float
    status: int | None
    error: str | None


@dataclass
class Stream:
    target: str
    kind: str
    tokens: int = 0
    done: bool = False
    error_events: int = 0
    ended_at: float = 0.0
    error: str | None = None
    first_token: asyncio.Event = field(default_factory=asyncio.Event, repr=False)


def _body(model: str, stream: bool, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": stream, **extra}


@dataclass
class Load:
    """The loops' shared record: every request, and events for what the driver waits on."""

    requests: list[Request] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    answered: dict[str, asyncio.Event] = field(default_factory=dict)  # per target: a 200 seen
    restarted_at: float = float("inf")
    answered_after_restart: asyncio.Event = field(default_factory=asyncio.Event)


async def _loop(client: httpx.AsyncClient, target: str, url: str, model: str, load: Load) -> None:
    while not load.stop.is_set():
        started = time.monotonic()
        next_at = started + PACE[target]
        status, error = None, None
        try:
            response = await client.post(url, json=_body(model, False, max_tokens=4))
            status = response.status_code
            if status != 200:
                error = response.text[:300]
        except httpx.HTTPError as exc:
            error = f"{type(exc).__name__}: {exc}"
        load.requests.append(Request(target, started, time.monotonic() - started, status, error))
        if status == 200:
            load.answered[target].set()
            if started > load.restarted_at:
                load.answered_after_restart.set()
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))


async def _stream(client: httpx.AsyncClient, url: str, model: str, stream: Stream) -> None:
    body = _body(model, True, **(SHORT_STREAM if stream.kind == "short" else LONG_STREAM))
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                stream.error = f"status {response.status_code}: {(await response.aread())[:300]!r}"
                return
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    stream.done = True
                elif line.startswith("data: ") and '"error"' in line[:20]:
                    stream.error_events += 1
                elif line.startswith("data: "):
                    stream.tokens += 1
                    stream.first_token.set()
    except httpx.HTTPError as exc:
        stream.error = f"{type(exc).__name__}: {exc}"
    finally:
        stream.ended_at = time.monotonic()
        stream.first_token.set()


async def main(args: argparse.Namespace) -> dict[str, Any]:
    targets = {"direct": args.direct, "nginx": args.nginx}
    headers = {"Authorization": f"Bearer {args.key}"}
    timeout = httpx.Timeout(args.grace + 60, connect=args.grace + 30)
    load = Load(answered={name: asyncio.Event() for name in targets})
    async with httpx.AsyncClient(headers=headers, timeout=timeout, verify=False) as client:
        loops = [
            asyncio.create_task(_loop(client, name, f"{url}/v1/chat/completions", args.model, load))
            for name, url in targets.items()
            for _ in range(LOOPS_PER_TARGET)
        ]
        kinds = ("short", "short", "long") if args.long_streams else ("short", "short")
        streams = [Stream(name, kind) for name in targets for kind in kinds]
        stream_tasks = [
            asyncio.create_task(_stream(client, f"{targets[s.target]}/v1/chat/completions", args.model, s))
            for s in streams
        ]
        await asyncio.wait_for(asyncio.gather(*(event.wait() for event in load.answered.values())), 60)
        await asyncio.wait_for(asyncio.gather(*(s.first_token.wait() for s in streams)), 60)

        restart_at = time.monotonic()
        restart = await asyncio.create_subprocess_exec("systemctl", "restart", "nemotron-gateway.service")
        await restart.wait()
        restarted_at = load.restarted_at = time.monotonic()
        # Go on until requests sent after the restart command returned are answered, then a little longer.
        await asyncio.wait_for(load.answered_after_restart.wait(), 120)
        await asyncio.sleep(AFTER)
        load.stop.set()
        await asyncio.wait_for(asyncio.gather(*loops), args.grace + 60)
        await asyncio.wait_for(asyncio.gather(*stream_tasks), args.grace + 60)

    requests = load.requests
    around = [r for r in requests if r.started + r.latency >= restart_at]
    return {
        "restart_command_s": restarted_at - restart_at,
        "requests": len(requests),
        "failed": [asdict(r) for r in requests if r.error is not None],
        "longest_wait_s": max((r.latency for r in around), default=0.0),
        "longest_wait_by_target_s": {
            name: max((r.latency for r in around if r.target == name), default=0.0) for name in targets
        },
        "answered_after_restart": sum(r.started > restarted_at and r.status == 200 for r in requests),
        "streams": [
            {
                "target": s.target,
                "kind": s.kind,
                "tokens": s.tokens,
                "done": s.done,
                "error_events": s.error_events,
                "error": s.error,
                "ended_after_s": s.ended_at - restart_at,
            }
            for s in streams
        ],
        "restart_exit": restart.returncode,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--direct", required=True)
    parser.add_argument("--nginx", required=True)
    parser.add_argument("--key", required=True)
    parser.add_argument("--model", default="nemotron")
    parser.add_argument("--grace", type=float, required=True)
    parser.add_argument("--long-streams", action="store_true", help="also streams that outlast the grace")
    sys.stdout.write(json.dumps(asyncio.run(main(parser.parse_args()))) + "\n")
