"""The client's reasoning switch, translated into the served model's convention.

Clients send OpenAI's `reasoning_effort` ("none"/"minimal" off, anything else on) or `"reasoning": {"enabled":
bool}` (`{"effort": ...}` read like `reasoning_effort`); the model preset says how the served model hears it:
`chat_template_kwargs.enable_thinking`, a `/think` / `/no_think` line in the system message, or `detailed
thinking on/off` there. Without a switch the request is left as the client wrote it, so the model's own default
applies. Imports errors, settings and the presets' data only.
"""

from __future__ import annotations

import functools
import logging
import re
from pathlib import Path
from typing import Any

from gateway.engine.presets import ReasoningSwitch, reasoning_switch
from gateway.engine.profiles import ProfileError
from gateway.errors import InvalidRequestError
from gateway.settings import EngineSettings

__all__ = [
    "ReasoningSwitch",
    "apply_reasoning",
    "apply_responses_reasoning",
    "clamp_thinking_budget",
    "served_switch",
]

logger = logging.getLogger(__name__)

_OFF_EFFORTS = frozenset(("none", "minimal"))
# vLLM's thinking budget (chat and text completions); Anthropic's Messages API says `thinking.budget_tokens`,
# which vLLM reads as the same budget.
THINKING_BUDGET = "thinking_token_budget"
_THINK_LINES = {True: "/think", False: "/no_think"}
_DETAILED = {True: "detailed thinking on", False: "detailed thinking off"}
# A switch the client wrote into its own system message, replaced by the one the request's switch asks for.
_CLIENT_LINES = {
    ReasoningSwitch.THINK_LINE: re.compile(r"^[ \t]*/(?:no_)?think[ \t]*$\n?", re.MULTILINE),
    ReasoningSwitch.DETAILED_THINKING: re.compile(r"^[ \t]*detailed thinking (?:on|off)[ \t]*$\n?", re.MULTILINE),
}


@functools.cache
def _switch_of(preset: str, profiles_file: Path | None) -> ReasoningSwitch:
    try:
        return reasoning_switch(preset, profiles_file)
    except ProfileError as exc:
        # The supervisor refuses to start with such a preset; a gateway alone still serves, without translation.
        logger.error("reasoning switch off: %s", exc)
        return ReasoningSwitch.NONE


def served_switch(engine: EngineSettings) -> ReasoningSwitch:
    """The configured preset's reasoning switch, read once per preset and file."""
    return _switch_of(engine.preset, engine.profiles_file)


def requested(data: dict[str, Any]) -> bool | None:
    """The switch the client sent (None: none), from `reasoning.enabled` or `reasoning_effort`; a 400 when they
    disagree."""
    toggle = data.get("reasoning") or {}
    effort = data.get("reasoning_effort")
    from_effort = None if effort is None else effort not in _OFF_EFFORTS
    from_toggle = toggle.get("enabled")
    if from_toggle is None and toggle.get("effort") is not None:
        from_toggle = toggle["effort"] not in _OFF_EFFORTS
    if from_toggle is not None and from_effort is not None and from_toggle != from_effort:
        raise InvalidRequestError(
            f"'reasoning' switches reasoning {'on' if from_toggle else 'off'} but 'reasoning_effort' {effort!r} "
            f"switches it {'on' if from_effort else 'off'}; send one of them.",
            param="reasoning",
        )
    return from_toggle if from_toggle is not None else from_effort


def _with_line(content: Any, line: str, pattern: re.Pattern[str], *, first: bool) -> Any:
    """The system content with the client's own switch lines removed and `line` added first or last."""
    if isinstance(content, list):
        parts = [
            {**part, "text": pattern.sub("", part["text"])} if part.get("type") == "text" else part for part in content
        ]
        added = {"type": "text", "text": line}
        return [added, *parts] if first else [*parts, added]
    text = pattern.sub("", content or "").strip("\n")
    if not text:
        return line
    return f"{line}\n{text}" if first else f"{text}\n{line}"


def _set_system_line(messages: list[dict[str, Any]], line: str, switch: ReasoningSwitch) -> None:
    # Merged into the first system message, never replacing it; a system message of its own when there is none.
    system = next((m for m in messages if m["role"] == "system"), None)
    if system is None:
        messages.insert(0, {"role": "system", "content": line})
        return
    # The Llama-Nemotron model card puts `detailed thinking on/off` first; /think and /no_think close the message.
    first = switch is ReasoningSwitch.DETAILED_THINKING
    system["content"] = _with_line(system.get("content"), line, _CLIENT_LINES[switch], first=first)


def apply_reasoning(data: dict[str, Any], switch: ReasoningSwitch) -> None:
    """Translate the request's switch (if any) into `switch`, in place; the switch fields are consumed.

    A model without a reasoning mode (or a preset that declares none) keeps `reasoning_effort` as sent: vLLM
    reads it for models it knows. Runs after the default system message is in place, so that message keeps
    the switch too.
    """
    enabled = requested(data)
    data.pop("reasoning", None)
    if switch is ReasoningSwitch.NONE or enabled is None:
        return
    data.pop("reasoning_effort", None)
    if switch is ReasoningSwitch.ENABLE_THINKING:
        data["chat_template_kwargs"] = {**(data.get("chat_template_kwargs") or {}), "enable_thinking": enabled}
        return
    if switch is ReasoningSwitch.THINK_LINE:
        _set_system_line(data["messages"], _THINK_LINES[enabled], switch)
        # vLLM's nemotron_v3 reasoning parser reads enable_thinking: with it false, an answer without </think>
        # is content, not reasoning. Templates that do not use the variable ignore it.
        data["chat_template_kwargs"] = {**(data.get("chat_template_kwargs") or {}), "enable_thinking": enabled}
        return
    _set_system_line(data["messages"], _DETAILED[enabled], switch)


def apply_responses_reasoning(data: dict[str, Any], switch: ReasoningSwitch) -> None:
    """The Responses API's `reasoning.effort` translated into `switch`, in place, as `apply_reasoning` does for
    chat: `instructions` is the system message a line goes into. `reasoning` stays for vLLM (its summary)."""
    reasoning = data.get("reasoning") or {}
    effort = reasoning.get("effort")
    if switch is ReasoningSwitch.NONE or effort is None:
        return
    instructions = data.get("instructions")
    chat_view: dict[str, Any] = {
        "reasoning_effort": effort,
        "messages": [] if instructions is None else [{"role": "system", "content": instructions}],
    }
    if data.get("chat_template_kwargs") is not None:
        chat_view["chat_template_kwargs"] = data["chat_template_kwargs"]
    apply_reasoning(chat_view, switch)
    if "chat_template_kwargs" in chat_view:
        data["chat_template_kwargs"] = chat_view["chat_template_kwargs"]
    if chat_view["messages"]:
        data["instructions"] = chat_view["messages"][0]["content"]


def clamp_thinking_budget(data: dict[str, Any], ceiling: int | None) -> None:
    """Cut a thinking budget above `ceiling` (the most tokens the request may generate: its max tokens, else the
    context length) down to it, in place; -1 (no budget) stays. A budget past the ceiling is never reached, so the
    answer is the same, but vLLM keeps each request's budget in a 32-bit tensor on the GPU, which a larger number
    overflows in the engine process, not at its request validation. Anthropic's `thinking.budget_tokens` is left
    alone: vLLM requires it below `max_tokens` and from 1024 (validation says so), so a cut one could be refused."""
    if ceiling is None:
        return
    budget = data.get(THINKING_BUDGET)
    if isinstance(budget, int) and budget > ceiling:
        data[THINKING_BUDGET] = ceiling
