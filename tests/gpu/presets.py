"""One model preset checked through a running gateway (the `presets` step of loadtest/gpu/run).

Random weights say nothing about answers, so this checks what a preset promises: the stack started, a streamed
answer arrives through the gateway ending in [DONE], the client's reasoning switch reaches the prompt vLLM renders
(vLLM's `return_token_ids` and its /detokenize), and, for a preset with the `nemotron_json` tool parser, a
`<TOOLCALL>` the model is made to emit (logit_bias on the demo tokenizer's tool-call token) comes back as
`tool_calls`. Writes one JSON line of results. Imports httpx only, never the gateway.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import httpx

# The marker each preset's reasoning switch leaves in the rendered prompt (off, on), with the template the step
# writes for the enable_thinking models (their own template closes an empty <think></think> when it is off).
MARKERS = {
    "nemotron-3-nano": ("<think></think>", "<think>\n"),
    "nemotron-3-nano-4b": ("<think></think>", "<think>\n"),  # the Nemotron 3 chat template of nemotron-3-nano
    "nemotron-nano-9b-v2": ("/no_think", "/think"),
}
TOOL_CALL_TOKEN = '<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</TOOLCALL>'
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}


def _post(client: httpx.Client, url: str, body: dict[str, Any]) -> dict[str, Any]:
    answer = client.post(url, json=body)
    answer.raise_for_status()
    return dict(answer.json())


def streamed(client: httpx.Client, gateway: str, model: str) -> dict[str, Any]:
    """A streamed chat answer through the gateway: chunks, time to the first, and whether [DONE] came."""
    started = time.monotonic()
    first: float | None = None
    chunks, done = 0, False
    body = {"model": model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32, "stream": True}
    with client.stream("POST", f"{gateway}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunks += 1
                first = first if first is not None else time.monotonic() - started
    return {"chunks": chunks, "done": done, "ttft_s": round(first or 0.0, 3)}


def rendered(client: httpx.Client, gateway: str, engine: str, model: str, switch: dict[str, Any]) -> str:
    """The prompt vLLM rendered for a request with this switch (its token ids, detokenized by the engine)."""
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "return_token_ids": True}
    ids = _post(client, f"{gateway}/v1/chat/completions", {**body, **switch})["prompt_token_ids"]
    return str(_post(client, f"{engine}/detokenize", {"model": model, "tokens": ids})["prompt"])


def reasoning(client: httpx.Client, gateway: str, engine: str, model: str, preset: str) -> dict[str, Any]:
    off_marker, on_marker = MARKERS[preset]
    off = rendered(client, gateway, engine, model, {"reasoning_effort": "none"})
    on = rendered(client, gateway, engine, model, {"reasoning": {"enabled": True}})
    return {"off_in_prompt": off_marker in off, "on_in_prompt": on_marker in on and off_marker not in on}


def tool_call(client: httpx.Client, gateway: str, engine: str, model: str) -> dict[str, Any]:
    token = _post(
        client, f"{engine}/tokenize", {"model": model, "prompt": TOOL_CALL_TOKEN, "add_special_tokens": False}
    )
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [WEATHER],
        "tool_choice": "auto",
        "max_tokens": 1,
        "logit_bias": {str(token["tokens"][0]): 100},
        # Reasoning off: random weights never close </think>, so the reasoning parser would keep the call as
        # reasoning text; off, the output is the answer and the tool parser reads it.
        "reasoning": {"enabled": False},
    }
    message = _post(client, f"{gateway}/v1/chat/completions", body)["choices"][0]["message"]
    calls = message.get("tool_calls") or []
    return {
        "tool_calls": [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls],
        "content": message.get("content"),
        "reasoning": message.get("reasoning_content") or message.get("reasoning"),
    }


THINKING_SUFFIX = (
    "{% if add_generation_prompt %}{% if enable_thinking is defined and not enable_thinking %}<think></think>"
    "{% else %}<think>\n{% endif %}{% endif %}"
)


def add_thinking_template(model_dir: str) -> None:
    """Give the demo tokenizer's template Nemotron 3's enable_thinking ending, so the switch shows in the prompt."""
    path = f"{model_dir}/tokenizer_config.json"
    with open(path) as handle:
        config = json.load(handle)
    config["chat_template"] += THINKING_SUFFIX
    with open(path, "w") as handle:
        json.dump(config, handle)


def check(args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {"preset": args.preset, "ready_s": args.ready_s}
    checks: dict[str, Callable[[httpx.Client], dict[str, Any]]] = {
        "stream": lambda client: streamed(client, args.gateway, args.model),
        "reasoning": lambda client: reasoning(client, args.gateway, args.engine, args.model, args.preset),
    }
    if args.preset == "nemotron-nano-9b-v2":  # the nemotron_json parser; Nemotron 3's qwen3_coder reads <tool_call>
        checks["tools"] = lambda client: tool_call(client, args.gateway, args.engine, args.model)
    with httpx.Client(headers={"Authorization": f"Bearer {args.api_key}"}, timeout=300) as client:
        for name, run in checks.items():
            try:
                result[name] = run(client)
            except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
                result[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.gpu.presets")
    steps = parser.add_subparsers(dest="step", required=True)
    template = steps.add_parser("template", help="add Nemotron 3's enable_thinking ending to a model's template")
    template.add_argument("model_dir")
    run = steps.add_parser("check", help="check one preset through the running gateway; one JSON line")
    run.add_argument("--preset", required=True, choices=sorted(MARKERS))
    run.add_argument("--gateway", default="http://127.0.0.1:8000")
    run.add_argument("--engine", default="http://127.0.0.1:8001")
    run.add_argument("--api-key", required=True)
    run.add_argument("--model", default="nemotron")
    run.add_argument("--ready-s", type=float, required=True, help="start-up time measured by the caller")
    args = parser.parse_args(argv)
    if args.step == "template":
        add_thinking_template(args.model_dir)
        return 0
    sys.stdout.write(json.dumps(check(args)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
