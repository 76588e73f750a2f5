"""The Responses API and Anthropic's Messages API checked through a running gateway, with the standard library only
(the GPU machine has neither the openai nor the anthropic package).

`python3 tests/gpu/apis.py --url http://127.0.0.1:8000 --key sk-... [--model nemotron] [--max-tokens 32]`
runs one Responses stream, one Responses answer, one Messages stream and one Messages answer and prints one JSON
line: for each, the HTTP status, the event names seen in order (streams), the text length, the usage and any
error. Exit status 0 when all four finished well, 1 otherwise. Imports nothing from `gateway`.
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import time
import urllib.parse
from typing import Any

_TIMEOUT = 300.0


def _post(url: str, path: str, key: str, body: dict[str, Any], headers: dict[str, str]) -> http.client.HTTPResponse:
    parts = urllib.parse.urlsplit(url)
    connection_class = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    connection = connection_class(parts.hostname or "127.0.0.1", parts.port, timeout=_TIMEOUT)
    sent = {"Content-Type": "application/json", **headers}
    connection.request("POST", parts.path.rstrip("/") + path, json.dumps(body), sent)
    return connection.getresponse()


def _events(response: http.client.HTTPResponse) -> list[tuple[str, Any]]:
    """(event name, parsed data) of each SSE event; comments (keep-alives) skipped."""
    events: list[tuple[str, Any]] = []
    name, data = "", ""
    for raw in response:
        line = raw.decode("utf-8").rstrip("\r\n")
        if not line:
            if data:
                events.append((name or "message", json.loads(data) if data != "[DONE]" else data))
            name, data = "", ""
        elif line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data += line[5:].strip()
    return events


def _result(started: float, status: int) -> dict[str, Any]:
    # `seconds` is set again once the whole answer is read (see `_timed`).
    return {"status": status, "seconds": None, "error": None, "started": started}


def _timed(result: dict[str, Any]) -> dict[str, Any]:
    """`result` with the seconds from the request to the end of its answer."""
    result["seconds"] = round(time.perf_counter() - result.pop("started"), 3)
    return result


def responses(url: str, key: str, model: str, max_tokens: int, *, stream: bool) -> dict[str, Any]:
    """One Responses API request; what came back."""
    body = {"model": model, "input": "Say hello.", "instructions": "Answer briefly.", "max_output_tokens": max_tokens}
    started = time.perf_counter()
    response = _post(url, "/v1/responses", key, {**body, "stream": stream}, {"Authorization": f"Bearer {key}"})
    result = _result(started, response.status)
    if response.status != 200:
        result["error"] = json.loads(response.read() or b"null")
        return result
    if not stream:
        answer = json.loads(response.read())
        texts = [c.get("text", "") for item in answer.get("output", []) for c in item.get("content") or []]
        result.update(text_length=len("".join(texts)), usage=answer.get("usage"), state=answer.get("status"))
        return result
    events = _events(response)
    result["events"] = [name for name, _ in events]
    result["text_length"] = sum(len(d.get("delta", "")) for n, d in events if n == "response.output_text.delta")
    last_name, last = events[-1] if events else ("", {})
    result["usage"] = (last.get("response") or {}).get("usage") if isinstance(last, dict) else None
    if last_name != "response.completed":
        result["error"] = last
    return result


def messages(url: str, key: str, model: str, max_tokens: int, *, stream: bool) -> dict[str, Any]:
    """One Anthropic Messages request (`x-api-key`, `anthropic-version`, as the Anthropic SDK sends); what came
    back."""
    body = {"model": model, "max_tokens": max_tokens, "messages": [{"role": "user", "content": "Say hello."}]}
    headers = {"x-api-key": key, "anthropic-version": "2023-06-01"}
    started = time.perf_counter()
    response = _post(url, "/v1/messages", key, {**body, "stream": stream}, headers)
    result = _result(started, response.status)
    if response.status != 200:
        result["error"] = json.loads(response.read() or b"null")
        return result
    if not stream:
        answer = json.loads(response.read())
        texts = [block.get("text", "") for block in answer.get("content", [])]
        result.update(text_length=len("".join(texts)), usage=answer.get("usage"), state=answer.get("stop_reason"))
        return result
    events = _events(response)
    result["events"] = [name for name, _ in events]
    deltas = [d.get("delta") or {} for n, d in events if n == "content_block_delta"]
    result["text_length"] = sum(len(delta.get("text", "")) for delta in deltas)
    result["usage"] = next((d.get("usage") for n, d in reversed(events) if n == "message_delta"), None)
    if not events or events[-1][0] != "message_stop":
        result["error"] = events[-1][1] if events else "no events"
    return result


def main(argv: list[str] | None = None) -> int:
    """Run the four checks, print one JSON line; 0 when all finished well."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True, help="the gateway, e.g. http://127.0.0.1:8000")
    parser.add_argument("--key", required=True, help="a gateway API key")
    parser.add_argument("--model", default="nemotron")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    report: dict[str, Any] = {"url": args.url, "model": args.model}
    for name, check, stream in (
        ("responses_stream", responses, True),
        ("responses", responses, False),
        ("messages_stream", messages, True),
        ("messages", messages, False),
    ):
        try:
            report[name] = _timed(check(args.url, args.key, args.model, args.max_tokens, stream=stream))
        except (OSError, http.client.HTTPException, ValueError) as exc:
            report[name] = {"status": None, "error": f"{type(exc).__name__}: {exc}"}
    sys.stdout.write(json.dumps(report) + "\n")
    checks = [report[name] for name in ("responses_stream", "responses", "messages_stream", "messages")]
    return 0 if all(c.get("status") == 200 and c.get("error") is None and c.get("usage") for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
