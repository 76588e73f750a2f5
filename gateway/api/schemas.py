"""Pydantic models of the OpenAI request fields the gateway polices.

Strict types (`"stream": "yes"` is an error, not True); `extra="allow"` so fields the gateway does not
know (vLLM's extra sampling parameters) pass through. The validated models are only used to check;
the request forwarded to the engine is the client's own JSON, with policy edits applied.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, field_validator, model_validator

# `developer` is OpenAI's newer name for `system` (current SDK examples, agent frameworks); sent on as `system`.
ROLES = ("system", "developer", "user", "assistant", "tool")
Role = Literal["system", "developer", "user", "assistant", "tool"]
# OpenAI's `reasoning_effort` values; "none" and "minimal" switch reasoning off, the rest on (gateway/api/reasoning.py).
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class ContentPart(_Strict):
    """One element of a list-form `content`; text parts must carry a string `text`."""

    type: StrictStr
    text: StrictStr | None = None

    @model_validator(mode="after")
    def _text_part_has_text(self) -> ContentPart:
        if self.type == "text" and self.text is None:
            raise ValueError("a content part of type 'text' needs a string 'text'")
        return self


class ChatMessage(_Strict):
    """A chat message: role exactly one of system, developer, user, assistant, tool."""

    role: Role
    content: StrictStr | list[ContentPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: StrictStr | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content_shape(cls, value: Any) -> Any:
        # Checked here so the client gets one clear message instead of one error per union member.
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(part, dict) for part in value):
            return value
        raise ValueError("content must be a string or a list of content parts like {'type': 'text', 'text': '...'}")

    @model_validator(mode="after")
    def _content_present(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (a string)")
        return self


class ReasoningToggle(_Strict):
    """`"reasoning": {"enabled": bool}` (or `{"effort": ...}`, as OpenRouter-style clients send): the gateway's
    explicit reasoning switch."""

    enabled: bool | None = None
    effort: ReasoningEffort | None = None

    @model_validator(mode="after")
    def _says_something(self) -> ReasoningToggle:
        if self.enabled is None and self.effort is None:
            raise ValueError('send {"enabled": true} or {"enabled": false}')
        return self


class StreamOptions(_Strict):
    """`stream_options`; the gateway always asks the engine for usage and strips it when not wanted."""

    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


def _check_stop(value: Any) -> Any:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return value
    raise ValueError("stop must be a string or a list of strings")


Probability = Annotated[float, Field(ge=0.0, le=1.0)]
# Token ids index a vocabulary; no tokenizer has 2**31 entries, and the engine stores them as 32-bit ints.
_TOKEN_ID_BOUND = 2**31
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class _SamplingFields(_Strict):
    """Fields shared by chat and text completions."""

    model: StrictStr
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    # Every token count is a strict, bounded integer: a negative or mistyped one would drive the up-front
    # token charge to zero or fail the budget arithmetic.
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    min_tokens: StrictInt | None = Field(None, ge=0)
    n: StrictInt | None = Field(None, ge=1)
    # Read by the choice cap and the up-front charge on both routes, so typed on both (vLLM's chat ignores it).
    best_of: StrictInt | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: Probability | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    seed: StrictInt | None = None
    stop: Any = None
    user: StrictStr | None = None
    logit_bias: dict[StrictStr, float] | None = None
    # vLLM's cap on reasoning tokens (-1: none); a whole number, cut to the completion budget (api/reasoning.py).
    thinking_token_budget: StrictInt | None = Field(None, ge=-1)

    _stop = field_validator("stop", mode="before")(_check_stop)


class ChatCompletionRequest(_SamplingFields):
    """Body of POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = None
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None
    reasoning_effort: ReasoningEffort | None = None
    reasoning: ReasoningToggle | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(_SamplingFields):
    """Body of POST /v1/completions."""

    prompt: Any
    echo: bool | None = None
    logprobs: StrictInt | None = Field(None, ge=0, le=20)
    suffix: StrictStr | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        if isinstance(value, str) and value:
            return value
        if isinstance(value, list) and value:
            if all(isinstance(item, str) and item for item in value):
                return value
            if _token_ids(value):
                return value
            if all(isinstance(item, list) and _token_ids(item) for item in value):
                return value
        raise ValueError(
            "prompt must be a non-empty string, a list of non-empty strings, a list of token ids (whole numbers "
            "from 0), or a list of lists of token ids"
        )


def _token_ids(items: list[Any]) -> bool:
    # `type(...) is int` rather than isinstance: True and False are ints to Python, not token ids.
    return bool(items) and all(type(item) is int and 0 <= item < _TOKEN_ID_BOUND for item in items)


def _items_of_dicts(value: Any, what: str) -> Any:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(item, dict) for item in value):
        return value
    raise ValueError(f"{what} must be a string or a list of objects")


class ResponsesReasoning(_Strict):
    """The Responses API's `reasoning`: `effort` is the switch (gateway/api/reasoning.py)."""

    effort: ReasoningEffort | None = None
    summary: StrictStr | None = None


class ResponsesContentPart(_Strict):
    """One part of a Responses message's `content` list (`input_text`, `output_text`, `input_image`, ...): a typed
    object whose `text`, where it has one, is a string."""

    type: StrictStr
    text: StrictStr | None = None


class ResponsesInputItem(_Strict):
    """One item of a Responses `input` list: a message (`role` + `content`) or another typed item."""

    type: StrictStr | None = None
    role: Literal["system", "developer", "user", "assistant"] | None = None
    content: StrictStr | list[ResponsesContentPart] | None = None

    _content = field_validator("content", mode="before")(lambda value: _items_of_dicts(value, "content"))

    @model_validator(mode="after")
    def _typed_or_message(self) -> ResponsesInputItem:
        if self.type is None and self.role is None:
            raise ValueError("an input item needs a 'role' (a message) or a 'type'")
        return self


class ResponsesRequest(_Strict):
    """Body of POST /v1/responses (OpenAI's Responses API)."""

    model: StrictStr
    input: StrictStr | list[ResponsesInputItem]
    instructions: StrictStr | None = None
    max_output_tokens: StrictInt | None = Field(None, ge=1)
    stream: bool | None = None
    store: bool | None = None
    background: bool | None = None
    previous_response_id: StrictStr | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: Probability | None = None
    reasoning: ResponsesReasoning | None = None
    tools: list[dict[str, Any]] | None = None
    metadata: dict[str, StrictStr] | None = None
    user: StrictStr | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _input_shape(cls, value: Any) -> Any:
        if isinstance(value, str) and value:
            return value
        if isinstance(value, list) and value and all(isinstance(item, dict) for item in value):
            return value
        raise ValueError("input must be a non-empty string or a non-empty list of input items (objects)")


class AnthropicBlock(_Strict):
    """One content block of an Anthropic message or system prompt; text blocks carry a string `text`."""

    type: StrictStr
    text: StrictStr | None = None

    @model_validator(mode="after")
    def _text_block_has_text(self) -> AnthropicBlock:
        if self.type == "text" and self.text is None:
            raise ValueError("a content block of type 'text' needs a string 'text'")
        return self


class AnthropicMessage(_Strict):
    """An Anthropic message: role `user` or `assistant`, content a string or a list of blocks."""

    role: Literal["user", "assistant"]
    content: StrictStr | list[AnthropicBlock]

    _content = field_validator("content", mode="before")(lambda value: _items_of_dicts(value, "content"))


class AnthropicTool(_Strict):
    """One Anthropic tool: a `name` and the JSON schema of its input."""

    name: StrictStr
    description: StrictStr | None = None
    input_schema: dict[str, Any]


class AnthropicToolChoice(_Strict):
    """`tool_choice`: `auto`, `any`, `none`, or `tool` with the tool's `name`."""

    type: Literal["auto", "any", "tool", "none"]
    name: StrictStr | None = None
    disable_parallel_tool_use: bool | None = None


# vLLM's (and Anthropic's) least thinking budget.
MIN_THINKING_BUDGET = 1024


class AnthropicThinking(_Strict):
    """`thinking`: `enabled` with a `budget_tokens` of at least 1024, `disabled`, or `adaptive`."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: StrictInt | None = Field(None, ge=MIN_THINKING_BUDGET)

    @model_validator(mode="after")
    def _enabled_has_budget(self) -> AnthropicThinking:
        if self.type == "enabled" and self.budget_tokens is None:
            raise ValueError(
                f"thinking of type 'enabled' needs 'budget_tokens', a whole number from {MIN_THINKING_BUDGET}"
            )
        return self


class AnthropicCountTokensRequest(_Strict):
    """Body of POST /v1/messages/count_tokens."""

    model: StrictStr
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: StrictStr | list[AnthropicBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: AnthropicThinking | None = None
    # Not Anthropic's, but the gateway reads it as the request's completion budget when a client sends it.
    max_tokens: StrictInt | None = Field(None, ge=1)

    _system = field_validator("system", mode="before")(lambda value: _items_of_dicts(value, "system"))


class AnthropicMetadata(_Strict):
    """`metadata`: Anthropic's `user_id`, a string."""

    user_id: StrictStr | None = None


class AnthropicMessagesRequest(AnthropicCountTokensRequest):
    """Body of POST /v1/messages (Anthropic's Messages API)."""

    max_tokens: StrictInt = Field(ge=1)  # required here, optional when counting
    stream: bool | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: Probability | None = None
    top_k: StrictInt | None = Field(None, ge=0)
    stop_sequences: list[StrictStr] | None = None
    metadata: AnthropicMetadata | None = None
