"""A Responses API request function for `vllm bench serve` on a vLLM that has none (0.26.0, the GPU machine's).

Registered by loadtest.gpu.bench only where `openai-responses` is missing; it reads the stream as vLLM 0.32's own
backend does, so a point measured with either means the same, but for `store`: POST /v1/responses (`input`,
`max_output_tokens`, `stream`, no `store`: OpenAI's default, true, which the gateway honours by keeping each response
in Redis while vLLM, whose own store is off, ignores it; vLLM 0.32's backend sends `store: false`). Each
`response.output_text.delta` / `response.reasoning_text.delta` event is a token (TTFT at the first, ITL between
them), usage and success come from `response.completed` / `response.incomplete`, a failure is `error` /
`response.failed` or a stream that ends without its terminal event. Needs vLLM (imported here, so only the bench
process loads it).
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from typing import Any

import aiohttp
from vllm.benchmarks.lib.endpoint_request_func import (
    RequestFuncInput,
    RequestFuncOutput,
    StreamedResponseHandler,
    _get_headers,
    _update_headers_common,
    _update_payload_common,
)

TOKEN_EVENTS = frozenset({"response.output_text.delta", "response.reasoning_text.delta"})
TERMINAL_EVENTS = frozenset({"response.completed", "response.incomplete"})
ERROR_EVENTS = frozenset({"error", "response.failed"})


def sse_data(message: str) -> str | None:
    """The data of one SSE message (`event:` lines and comments skipped); None when it has none."""
    lines = [line[5:].lstrip() for line in message.splitlines() if line.startswith("data:")]
    return "\n".join(lines) if lines else None


async def request_openai_responses(
    request_func_input: RequestFuncInput, session: aiohttp.ClientSession, pbar: Any = None
) -> RequestFuncOutput:
    """One streamed Responses request, timed token by token (see the module docstring)."""
    payload: dict[str, Any] = {
        "model": request_func_input.model_name or request_func_input.model,
        "input": request_func_input.prompt,
        "max_output_tokens": request_func_input.output_len,
        "stream": True,
    }
    _update_payload_common(payload, request_func_input)
    headers = _get_headers("application/json")
    _update_headers_common(headers, request_func_input)
    output = RequestFuncOutput()
    output.prompt_len = request_func_input.prompt_len
    text, error, terminal, first = "", None, False, False
    started = last = time.perf_counter()
    output.start_time = started
    try:
        async with session.post(url=request_func_input.api_url, json=payload, headers=headers) as response:
            if response.status != 200:
                output.error = response.reason or str(response.status)
                return output
            handler = StreamedResponseHandler()
            async for chunk in response.content.iter_any():
                for message in handler.add_chunk(chunk):
                    data = sse_data(message)
                    if not data or data == "[DONE]":
                        continue
                    now = time.perf_counter()
                    event = json.loads(data)
                    kind = event.get("type")
                    if kind in TOKEN_EVENTS:
                        if first:
                            output.itl.append(now - last)
                        else:
                            first, output.ttft = True, now - started
                        if kind == "response.output_text.delta":
                            text += event.get("delta") or ""
                        last = now
                    elif kind in TERMINAL_EVENTS:
                        terminal = True
                        usage = (event.get("response") or {}).get("usage") or {}
                        if usage.get("output_tokens") is not None:
                            output.output_tokens = usage["output_tokens"]
                        if usage.get("input_tokens") is not None:
                            output.prompt_len = usage["input_tokens"]
                    elif kind in ERROR_EVENTS or event.get("error"):
                        error = json.dumps(event.get("error") or event)
        output.generated_text, output.latency = text, last - started
        if error is not None:
            output.error = error
        elif not first:
            output.error = "Never received a token delta to calculate TTFT."
        elif not terminal:
            output.error = "Stream ended without a terminal event."
        else:
            output.success = True
    except Exception:
        output.error = "".join(traceback.format_exception(*sys.exc_info()))
    finally:
        if pbar:
            pbar.update(1)
    return output
