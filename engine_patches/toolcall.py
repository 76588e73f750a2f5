"""`nemotron_json`: vLLM tool parser for the `<TOOLCALL>[{"name": ..., "arguments": {...}}, ...]</TOOLCALL>` format of
NVIDIA-Nemotron-Nano-9B-v2 (and 12B-v2), streaming and not.

NVIDIA's own parser (nemotron_toolcall_parser_no_streaming.py in the model repo) no longer imports on current
vLLM: the protocol classes moved and the constructor gained `tools` (vLLM issue #42065). This one is written
against the installed ToolParser API (0.32: `vllm.entrypoints.generate.base.protocol`; 0.26:
`vllm.entrypoints.openai.engine.protocol`, the only difference it meets). Loaded by vLLM through the plugin in
engine_patches.plugin, inside the engine process only.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from vllm.logger import init_logger
from vllm.tool_parsers.abstract_tool_parser import ToolParser

try:  # vLLM >= 0.30
    from vllm.entrypoints.generate.base.protocol import (
        DeltaFunctionCall,
        DeltaMessage,
        DeltaToolCall,
        ExtractedToolCallInformation,
        FunctionCall,
        ToolCall,
    )
    from vllm.renderers.chat_utils import make_tool_call_id
except ImportError:  # vLLM 0.26
    from vllm.entrypoints.chat_utils import make_tool_call_id
    from vllm.entrypoints.openai.engine.protocol import (
        DeltaFunctionCall,
        DeltaMessage,
        DeltaToolCall,
        ExtractedToolCallInformation,
        FunctionCall,
        ToolCall,
    )

__all__ = ["END", "START", "NemotronJsonToolParser", "parse_calls"]

logger = init_logger(__name__)

START = "<TOOLCALL>"
END = "</TOOLCALL>"


def parse_calls(payload: str) -> list[tuple[str, str]] | None:
    """(name, arguments as JSON text) for each call in a `[{"name": ..., "arguments": ...}, ...]` payload; None when
    the payload is not such a list (malformed JSON, a call without a name)."""
    try:
        calls = json.loads(payload)
    except ValueError:
        return None
    if isinstance(calls, dict):  # a single call without the list brackets: seen from small models
        calls = [calls]
    if not isinstance(calls, list) or not calls:
        return None
    found: list[tuple[str, str]] = []
    for call in calls:
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
            return None
        arguments = call.get("arguments", call.get("parameters", {}))
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        found.append((call["name"], arguments))
    return found


def _held_back(text: str) -> int:
    """How many characters at the end of `text` could be the start of `<TOOLCALL>` (not yet sent as content)."""
    for size in range(min(len(START) - 1, len(text)), 0, -1):
        if START.startswith(text[-size:]):
            return size
    return 0


class NemotronJsonToolParser(ToolParser):
    """Content before `<TOOLCALL>` is content; each block's JSON list becomes `tool_calls`; a malformed block stays
    content, so nothing the model wrote is lost."""

    def __init__(self, tokenizer: Any, tools: list[Any] | None = None) -> None:
        super().__init__(tokenizer, tools)
        # Streaming state: how much of the output is decided (sent as content or as tool calls), and whether the
        # last block's list was sent before its closing tag arrived.
        self._sent = 0
        self._after_open_list = False

    def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCallInformation:
        """The whole output at once (non-streamed responses)."""
        if START not in model_output:
            return ExtractedToolCallInformation(tools_called=False, tool_calls=[], content=model_output)
        content_parts: list[str] = []
        calls: list[ToolCall] = []
        rest = model_output
        while START in rest:
            before, _, after = rest.partition(START)
            content_parts.append(before)
            payload, closed, rest = after.partition(END)
            parsed = parse_calls(payload.strip())
            if parsed is None:
                logger.warning("nemotron_json: a %s block is not a JSON list of calls; returned as content", START)
                return ExtractedToolCallInformation(tools_called=False, tool_calls=[], content=model_output)
            calls += [
                ToolCall(id=make_tool_call_id(), type="function", function=FunctionCall(name=name, arguments=args))
                for name, args in parsed
            ]
            if not closed:
                rest = ""
        content_parts.append(rest)
        content = "".join(content_parts).strip()
        return ExtractedToolCallInformation(tools_called=True, tool_calls=calls, content=content or None)

    def extract_tool_calls_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
        request: Any,
    ) -> DeltaMessage | None:
        """One delta of a stream: content up to `<TOOLCALL>` (holding back what may be its start), then each block's
        calls once its JSON list is complete (name and arguments in one delta per call)."""
        content = ""
        calls: list[DeltaToolCall] = []
        while True:
            pending = current_text[self._sent :]
            if self._after_open_list:
                # A list sent before its closing tag came: skip the tag (and the blank before it) when it does.
                rest = pending.lstrip()
                if rest.startswith(END):
                    self._sent += len(pending) - len(rest) + len(END)
                    self._after_open_list = False
                    continue
                if END.startswith(rest):
                    break  # nothing yet, or part of the tag: wait for the rest
                self._after_open_list = False
            start = pending.find(START)
            if start < 0:
                keep = _held_back(pending)
                content += pending[: len(pending) - keep]
                self._sent += len(pending) - keep
                break
            content += pending[:start]
            payload, closed, _ = pending[start + len(START) :].partition(END)
            parsed = parse_calls(payload.strip())
            if parsed is None:
                if closed:  # a malformed block: what the model wrote goes out as content
                    block = START + payload + END
                    content += block
                    self._sent += start + len(block)
                    continue
                self._sent += start  # wait for the rest of the block
                break
            calls += self._start_calls(parsed)
            self._sent += start + len(START) + len(payload) + (len(END) if closed else 0)
            # A complete list before its closing tag is sent now (a stream may end there, at max_tokens or EOS).
            self._after_open_list = not closed
        if not content and not calls:
            return None
        return DeltaMessage(content=content or None, tool_calls=calls)

    def _start_calls(self, parsed: list[tuple[str, str]]) -> list[DeltaToolCall]:
        deltas = []
        for name, arguments in parsed:
            self.current_tool_id += 1
            self.prev_tool_call_arr.append({"name": name, "arguments": arguments})
            self.streamed_args_for_tool.append(arguments)
            deltas.append(
                DeltaToolCall(
                    index=self.current_tool_id,
                    id=make_tool_call_id(),
                    type="function",
                    function=DeltaFunctionCall(name=name, arguments=arguments).model_dump(exclude_none=True),
                )
            )
        self.current_tool_name_sent = True
        return deltas
