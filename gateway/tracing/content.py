"""The prompt and the completion as the GenAI conventions record them (`gen_ai.input.messages`,
`gen_ai.system_instructions`, `gen_ai.output.messages`), only where an operator turned content capture on.

`input_attributes` reads the body the gateway sent the engine (chat, completions, Responses, Messages), `OutputText`
gathers what the answer or its stream events carry. Text parts are kept as they are; anything else (images, tool
definitions) goes as its JSON. Imports nothing of ours.
"""

from __future__ import annotations

from typing import Any

import orjson

_Parts = list[dict[str, Any]]


def _parts(content: Any) -> _Parts:
    """A message's content as the conventions' parts: text as text, any other part as its JSON."""
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "content": content}]
    if isinstance(content, list):
        parts: _Parts = []
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append({"type": "text", "content": part["text"]})
            else:
                parts.append({"type": "generic", "content": orjson.dumps(part).decode()})
        return parts
    return [{"type": "generic", "content": orjson.dumps(content).decode()}]


def _message(role: Any, content: Any, tool_calls: Any = None) -> dict[str, Any]:
    parts = _parts(content)
    for call in tool_calls if isinstance(tool_calls, list) else ():
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            name, arguments = function.get("name"), function.get("arguments")
            parts.append({"type": "tool_call", "id": call.get("id"), "name": name, "arguments": arguments})
    return {"role": str(role or "user"), "parts": parts}


def input_attributes(body: bytes) -> dict[str, str]:
    """`gen_ai.input.messages` (and `gen_ai.system_instructions` where the API keeps them apart) as JSON strings."""
    try:
        request = orjson.loads(body)
    except orjson.JSONDecodeError:
        return {}
    if not isinstance(request, dict):
        return {}
    messages: list[dict[str, Any]] = []
    system: _Parts = []
    if isinstance(request.get("messages"), list):
        for entry in request["messages"]:
            if isinstance(entry, dict):
                messages.append(_message(entry.get("role"), entry.get("content"), entry.get("tool_calls")))
        system = _parts(request.get("system"))  # Anthropic's Messages keep the system prompt apart
    elif "prompt" in request:
        prompts = request["prompt"] if isinstance(request["prompt"], list) else [request["prompt"]]
        for prompt in prompts:
            messages.append(_message("user", prompt if isinstance(prompt, str) else orjson.dumps(prompt).decode()))
    elif "input" in request:
        given = request["input"]
        if isinstance(given, list):
            for item in given:
                if isinstance(item, dict) and "role" in item:
                    messages.append(_message(item.get("role"), item.get("content")))
                else:
                    messages.append({"role": "user", "parts": _parts([item])})
        else:
            messages.append(_message("user", given))
        system = _parts(request.get("instructions"))
    found = {"gen_ai.input.messages": orjson.dumps(messages).decode()}
    if system:
        found["gen_ai.system_instructions"] = orjson.dumps(system).decode()
    return found


class OutputText:
    """The answer's text, gathered from a whole answer or from its stream's events, for `gen_ai.output.messages`."""

    __slots__ = ("_final", "_pieces")

    def __init__(self) -> None:
        self._pieces: list[str] = []
        self._final: str | None = None  # a whole answer's text, which replaces the pieces

    def read(self, event: dict[str, Any]) -> None:
        """Take the text an answer or a stream event carries (chat and completions choices, the Responses API's
        `output_text` deltas and final output, Anthropic's text blocks and deltas)."""
        kind = event.get("type")
        if kind == "response.output_text.delta" and isinstance(event.get("delta"), str):
            self._pieces.append(event["delta"])
        elif kind == "content_block_delta":
            delta = event.get("delta")
            if isinstance(delta, dict) and isinstance(delta.get("text"), str):
                self._pieces.append(delta["text"])
        elif event.get("object") == "response" or kind in ("response.completed", "response.incomplete"):
            response = event.get("response", event)
            if isinstance(response, dict) and isinstance(response.get("output"), list):
                self._final = "".join(_output_text(item) for item in response["output"])
        elif kind == "message" and isinstance(event.get("content"), list):
            self._final = "".join(str(b.get("text", "")) for b in event["content"] if isinstance(b, dict))
        elif isinstance(event.get("choices"), list):
            for choice in event["choices"]:
                if not isinstance(choice, dict):
                    continue
                holder = choice.get("delta") or choice.get("message") or {}
                text = holder.get("content") if isinstance(holder, dict) else None
                if isinstance(choice.get("text"), str):
                    text = choice["text"]
                if isinstance(text, str):
                    self._pieces.append(text)

    def attribute(self, finish_reasons: list[str]) -> str:
        """`gen_ai.output.messages` as a JSON string: one assistant message with the text and the finish reason."""
        text = self._final if self._final is not None else "".join(self._pieces)
        message: dict[str, Any] = {"role": "assistant", "parts": [{"type": "text", "content": text}]}
        if finish_reasons:
            message["finish_reason"] = finish_reasons[0]
        return orjson.dumps([message]).decode()


def _output_text(item: Any) -> str:
    if not isinstance(item, dict) or not isinstance(item.get("content"), list):
        return ""
    return "".join(str(part.get("text", "")) for part in item["content"] if isinstance(part, dict))
