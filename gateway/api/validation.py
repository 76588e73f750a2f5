"""Turns a client's request body into the body sent to the engine, or a clear 400.

Checks the Nemotron pitfalls (README, "Serving Nemotron") and applies policy: model aliases, `developer` sent as
`system`, the default system message, the reasoning switch in the served model's convention, usage always requested
in streams. Cheap checks (the counts of messages and other lists, `gateway/api/bounds.py`) come before costly ones.
Imports settings, errors, bounds, schemas, reasoning and the relay's ModelInfo only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import orjson
from pydantic import BaseModel, ValidationError

from gateway.api.bounds import ROLE_MARKER, TYPE_MARKER, BodyBounds, count_entries
from gateway.api.reasoning import apply_reasoning, apply_responses_reasoning, clamp_thinking_budget, served_switch
from gateway.api.schemas import (
    MIN_THINKING_BUDGET,
    AnthropicCountTokensRequest,
    AnthropicMessagesRequest,
    ChatCompletionRequest,
    CompletionRequest,
    ResponsesRequest,
)
from gateway.errors import InvalidRequestError
from gateway.relay.served_model import ModelInfo, ServedModels
from gateway.settings import Settings

# Four characters a token is the usual estimate for English text; it only sizes the up-front
# token charge, which is reconciled with the engine's real count when the request ends.
_CHARS_PER_TOKEN = 4
_DEFAULT_MAX_TOKENS_ESTIMATE = 256

# vLLM's bound on `priority` (its request schemas: a signed 64-bit integer).
_INT64_MAX = 2**63 - 1
_UNION_TAGS = frozenset(("str", "int", "float", "bool", "list", "dict", "none"))
_JSON_TYPES = {"list": "array", "str": "string", "int": "number", "float": "number", "bool": "boolean"}

# What to send instead, by pydantic error type.
_HINTS: dict[str, str] = {
    "bool_type": "send true or false",
    "float_type": "send a number",
    "int_type": "send a whole number",
    "string_type": "send a string",
    "list_type": "send a JSON array",
    "dict_type": "send a JSON object",
    "model_type": "send a JSON object",
    "model_attributes_type": "send a JSON object",
    "missing": "this field is required",
}


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    """A validated request, ready for the engine."""

    body: bytes
    model: str
    stream: bool
    client_wants_usage: bool
    prompt_tokens_estimate: int
    max_tokens: int | None
    choices: int = 1
    requested_priority: int | None = None  # the client's own `priority` (taken out of `body`)
    # The API's field for the completion length when the client left that length to the engine (absent from `body`),
    # else None: `capped` may fill it in.
    open_budget_field: str | None = None
    # The field the gateway wrote its own cap into (`capped`), and the body before it: `recapped` may lower it.
    gateway_cap_field: str | None = None
    uncapped_body: bytes = b""
    # The model's context length (None: unknown), and the conversation's leading messages as JSON, at most
    # `routing.prefix_chars` bytes: what its replica affinity is hashed from.
    context_length: int | None = None
    leading: bytes = b""

    @property
    def generates(self) -> bool:
        """Whether the engine generates anything for it (counting tokens does not)."""
        return self.choices > 0

    @property
    def tokens_estimate(self) -> int:
        """Prompt estimate plus the completion budget of every choice the engine generates (`n`, `best_of`,
        each prompt of a batch): what a token limit charges up front. Nothing for a request that generates
        nothing."""
        if not self.generates:
            return 0
        return self.prompt_tokens_estimate + (self.max_tokens or _DEFAULT_MAX_TOKENS_ESTIMATE) * self.choices

    def capped(self, token_limit: int | None, context_length: int | None) -> PreparedRequest:
        """For a key with a token limit (`token_limit`: the smallest of its tokens/min and budgets), the request with
        an explicit completion length where the client left it to the engine, which may otherwise generate up to
        the context length while the key is charged a guess: the rest of the context (`context_length` less the
        prompt's estimate), bounded so that the whole request fits `token_limit`. That cap goes to the engine in
        the API's own field and is what `tokens_estimate` charges up front. Unchanged without a limit or with a
        length of the client's."""
        field = self.open_budget_field
        if token_limit is None or field is None:
            return self
        cap = (token_limit - self.prompt_tokens_estimate) // self.choices
        if context_length is not None:
            cap = min(cap, context_length - self.prompt_tokens_estimate)
        # At least one token: a prompt that fills the limit is then refused by it as too large, not sent uncapped.
        cap = max(1, cap)
        body = b'%s,"%s":%d}' % (self.body[:-1], field.encode(), cap)
        return replace(
            self, body=body, max_tokens=cap, open_budget_field=None, gateway_cap_field=field, uncapped_body=self.body
        )

    def recapped(self, tokens_left: int) -> PreparedRequest | None:
        """The request with the gateway's cap lowered so that the whole request fits the `tokens_left` of a budget
        that refused it; None when the cap is the client's, or when not one token fits (the refusal stands). A
        budget near its end then still serves a client that left the length to the engine, as far as it goes."""
        field = self.gateway_cap_field
        if field is None or self.max_tokens is None:
            return None
        cap = min(self.max_tokens, (tokens_left - self.prompt_tokens_estimate) // self.choices)
        if cap < 1 or cap == self.max_tokens:
            return None
        body = b'%s,"%s":%d}' % (self.uncapped_body[:-1], field.encode(), cap)
        return replace(self, body=body, max_tokens=cap)

    def engine_body(self, priority: int | None) -> bytes:
        """The body for the engine, with vLLM's `priority` field when `priority` is not None (the body is an
        orjson object without it, so the field goes in before its closing brace)."""
        if priority is None:
            return self.body
        return b'%s,"priority":%d}' % (self.body[:-1], priority)


def effective_priority(own: int | None, default: int, requested: int | None) -> int:
    """The priority a request is served at: its key's (`own`, else `default`), or the client's `requested` one
    when that is less urgent (larger); a client can never make itself more urgent than its key."""
    granted = default if own is None else own
    return granted if requested is None else max(granted, requested)


def _pop_priority(data: dict[str, Any]) -> int | None:
    """The client's `priority` (a whole number), taken out of the body: the gateway sends its own."""
    requested = data.pop("priority", None)
    if requested is None:
        return None
    if isinstance(requested, bool) or not isinstance(requested, int) or abs(requested) > _INT64_MAX:
        raise InvalidRequestError(
            "Invalid type for 'priority': send a whole number (larger is less urgent; your key's priority is the "
            "most urgent it may ask for).",
            param="priority",
        )
    return requested


# What a request's `model` is resolved against: the served models (the pool's), or one model alone.
Models = ModelInfo | ServedModels
Prepare = Callable[[bytes, Settings, Models], PreparedRequest]


def parse_json_object(body: bytes) -> dict[str, Any]:
    """The body as a JSON object, or a 400 saying what is wrong with it."""
    if not body.strip():
        raise InvalidRequestError("The request body is empty; send a JSON object.")
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequestError(f"The request body is not valid JSON ({exc}); send a JSON object.") from None
    if not isinstance(parsed, dict):
        raise InvalidRequestError(
            f"The request body must be a JSON object, not a JSON {_JSON_TYPES.get(type(parsed).__name__, 'null')}; "
            'send {"model": ..., "messages": [...]}.'
        )
    return parsed


def param_path(loc: tuple[int | str, ...]) -> str:
    """A pydantic error location as the client wrote it: `("messages", 1, "role")` -> `messages[1].role`."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else part
    return path


def _field_loc(loc: tuple[int | str, ...]) -> tuple[int | str, ...]:
    # pydantic puts union members and validator names into locations (`content.str`,
    # `content.list[ContentPart]`, `function-after[...]`); the client only knows field names.
    return tuple(
        part
        for part in loc
        if isinstance(part, int) or not (part in _UNION_TAGS or "[" in part or part.startswith("function-"))
    )


def _as_request_error(exc: ValidationError) -> InvalidRequestError:
    errors = exc.errors(include_url=False)
    # With a union, the deepest error is the one about what the client meant (a list's element,
    # not "should be a string").
    first_loc = _field_loc(errors[0]["loc"])
    same_field = [e for e in errors if _field_loc(e["loc"])[: len(first_loc)] == first_loc]
    error = max(same_field, key=lambda e: len(_field_loc(e["loc"])))
    loc = _field_loc(error["loc"])
    param = param_path(loc)
    kind = error["type"]
    if kind == "literal_error" and loc[-1:] == ("role",):
        # The roles this route's schema takes (chat's, the Responses API's or Anthropic's), as pydantic lists them.
        got, expected = error.get("input"), str((error.get("ctx") or {}).get("expected", "")).replace(" or ", ", ")
        return InvalidRequestError(f"Invalid role {got!r} at '{param}': use one of {expected}, lowercase.", param=param)
    if kind == "missing":
        return InvalidRequestError(f"Missing required parameter '{param}'.", param=param)
    if kind == "too_short" and param == "messages":
        return InvalidRequestError("'messages' is empty; send at least one message.", param=param)
    message = str(error["msg"]).removeprefix("Value error, ")
    advice = _HINTS.get(kind)
    got = ""
    if not isinstance(error["input"], dict | list):
        got = f" (got {orjson.dumps(error['input']).decode()[:80]})"
    text = f"Invalid value for '{param}': {message}{got}."
    if advice:
        text = f"{text[:-1]}; {advice}."
    return InvalidRequestError(text, param=param)


def _validate(model: type[BaseModel], data: dict[str, Any]) -> None:
    try:
        model.model_validate(data)
    except ValidationError as exc:
        raise _as_request_error(exc) from None


def _resolve_model(requested: str, settings: Settings, models: Models) -> ModelInfo:
    if isinstance(models, ModelInfo):
        return models.resolve(requested, settings.model_aliases)
    return models.resolve(requested)


# The system-like roles a conversation's leading messages may start with, before its first turn.
_LEADING_ROLES = ("system", "developer")


def leading_messages(data: dict[str, Any], limit: int) -> bytes:
    """The start of a conversation: its system prompt or instructions, any leading system messages, and its first
    turn (the first other message or input item, or the prompt), each as JSON cut to `limit` bytes. The same for
    every turn of one conversation, whatever follows, so its turns share a replica's prefix cache. Each part is cut
    on its own: a system prompt longer than the limit, which many conversations share, still leaves their first
    turns to tell them apart."""
    parts: list[Any] = [data.get("system"), data.get("instructions")]
    items = data.get("messages") or data.get("input") or data.get("prompt")
    for item in items if isinstance(items, list) else [items]:
        # A message as its role and content: a Responses input given as a string and the same message as an item
        # (how a later turn's history holds it) are one start.
        parts.append([item.get("role"), item.get("content")] if isinstance(item, dict) else ["user", item])
        if not (isinstance(item, dict) and item.get("role") in _LEADING_ROLES):
            break
    return b"\0".join(orjson.dumps(part)[:limit] for part in parts)


@dataclass(frozen=True, slots=True)
class _Route:
    """What differs between the chat and the text completion route."""

    schema: type[BaseModel]
    # The fields the engine takes its completion budget from, the one it prefers first.
    budget_fields: tuple[str, ...]
    # The lists validation walks entry by entry, counted before they are (messages, a batch's prompts, parts, ...).
    bounds: BodyBounds
    # How many prompts the engine completes (a batch completes each); 0: none (counting tokens only).
    prompts: Callable[[dict[str, Any]], int]
    # Whether the API has OpenAI's `stream_options` (the Responses and Messages APIs report usage in their
    # streams' last events anyway).
    stream_options: bool = True


def _check_choices(data: dict[str, Any], settings: Settings) -> int:
    """How many sequences the engine generates per prompt: `n`, or `best_of` when larger."""
    n: int = data.get("n") or 1
    best_of: int = data.get("best_of") or 1
    for field, value in (("n", n), ("best_of", best_of)):
        if value > settings.max_n:
            raise InvalidRequestError(
                f"'{field}' is {value}; this gateway allows at most {settings.max_n}.", param=field
            )
    if data.get("best_of") is not None and best_of < n:
        raise InvalidRequestError(f"'best_of' is {best_of}; it must be at least 'n' ({n}).", param="best_of")
    return max(n, best_of)


def _check_budget(data: dict[str, Any], route: _Route, info: ModelInfo) -> int | None:
    field = next((f for f in route.budget_fields if data.get(f) is not None), route.budget_fields[-1])
    max_tokens: int | None = data.get(field)
    if max_tokens is not None and info.context_length is not None and max_tokens > info.context_length:
        raise InvalidRequestError(
            f"'{field}' is {max_tokens}, more than the model's context length of {info.context_length} tokens "
            f"(prompt included); send at most {info.context_length} minus the prompt's length.",
            param=field,
        )
    return max_tokens


def _apply_stream_policy(data: dict[str, Any]) -> tuple[bool, bool]:
    stream = bool(data.get("stream"))
    options = data.get("stream_options")
    if not stream:
        if options is not None:
            raise InvalidRequestError("'stream_options' is only allowed with \"stream\": true.", param="stream_options")
        return False, False
    wants_usage = bool(options and options.get("include_usage"))
    if not wants_usage:
        # Ask the engine for usage anyway so accounting always has real token counts; the relay
        # strips that extra chunk again before the client sees it.
        data["stream_options"] = {**(options or {}), "include_usage": True}
    return True, wants_usage


def _text_length(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(part.get("text") or "") for part in content if isinstance(part, dict))
    return 0


def _serialise(data: dict[str, Any]) -> bytes:
    try:
        return orjson.dumps(data)
    except orjson.JSONEncodeError:
        # The parser accepts nesting up to 1024 levels, the serialiser only ~254: refuse
        # what the engine could not be sent, as a 400 rather than a 500.
        raise InvalidRequestError(
            "The request is nested too deeply (arrays or objects more than 250 levels inside each other); flatten it."
        ) from None


def _prepare(
    body: bytes,
    route: _Route,
    settings: Settings,
    models: Models,
    apply_policy: Callable[[dict[str, Any]], int],
) -> PreparedRequest:
    """Parse, count, validate, resolve the model, check choices and budget, apply the stream policy and the
    route's own policy (which returns the prompt's token estimate), and serialise what goes to the engine."""
    route.bounds.precount(body, settings)
    data = parse_json_object(body)
    route.bounds.check(data, settings, len(body))
    _validate(route.schema, data)
    requested_priority = _pop_priority(data)
    info = _resolve_model(data["model"], settings, models)
    model = data["model"] = info.name
    choices = (_check_choices(data, settings) if route.stream_options else 1) * route.prompts(data)
    max_tokens = _check_budget(data, route, info)
    open_field = None
    if max_tokens is None and route.prompts(data):
        # An explicit null goes as no field at all, so that a cap the gateway adds is the body's only one.
        for budget_field in route.budget_fields:
            data.pop(budget_field, None)
        open_field = route.budget_fields[0]
    clamp_thinking_budget(data, max_tokens if max_tokens is not None else info.context_length)
    if route.stream_options:
        stream, wants_usage = _apply_stream_policy(data)
    else:
        stream, wants_usage = data.get("stream") is True, True
    estimate = apply_policy(data)
    return PreparedRequest(
        body=_serialise(data),
        model=model,
        stream=stream,
        client_wants_usage=wants_usage,
        prompt_tokens_estimate=estimate,
        max_tokens=max_tokens,
        choices=choices,
        requested_priority=requested_priority,
        open_budget_field=open_field,
        context_length=info.context_length,
        leading=leading_messages(data, settings.routing.prefix_chars),
    )


def _batch(prompt: Any) -> int:
    # A list of strings or of token-id lists is a batch; a flat list of token ids is one prompt.
    return len(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list) else 0


_CHAT = _Route(
    schema=ChatCompletionRequest,
    budget_fields=("max_completion_tokens", "max_tokens"),
    bounds=BodyBounds(
        items_field="messages",
        items=lambda data: count_entries(data, "messages"),
        item_marker=ROLE_MARKER,
        entries=("messages[].content", "messages[].tool_calls", "tools", "stop", "logit_bias"),
        entry_marker=TYPE_MARKER,
    ),
    prompts=lambda data: 1,
)
_COMPLETION = _Route(
    schema=CompletionRequest,
    # vLLM's completions take max_tokens only.
    budget_fields=("max_tokens",),
    bounds=BodyBounds(
        items_field="prompt", items=lambda data: _batch(data.get("prompt")), entries=("stop", "logit_bias")
    ),
    prompts=lambda data: max(1, _batch(data["prompt"])),
)


def prepare_chat(body: bytes, settings: Settings, models: Models) -> PreparedRequest:
    """Validate a chat completion request and apply policy; raises InvalidRequestError / NotFoundError."""

    def policy(data: dict[str, Any]) -> int:
        messages: list[dict[str, Any]] = data["messages"]
        for message in messages:
            if message["role"] == "developer":  # OpenAI's newer name for it; chat templates know `system`
                message["role"] = "system"
        if settings.inject_system_message and not any(m["role"] == "system" for m in messages):
            data["messages"] = [{"role": "system", "content": settings.default_system_message}, *messages]
        # After the default message is in: a switch that lives in the system prompt is merged into it.
        apply_reasoning(data, served_switch(settings.engine))
        return sum(_text_length(m.get("content")) for m in data["messages"]) // _CHARS_PER_TOKEN + 1

    return _prepare(body, _CHAT, settings, models, policy)


def _prompt_estimate(data: dict[str, Any]) -> int:
    prompt = data["prompt"]
    if isinstance(prompt, str):
        return len(prompt) // _CHARS_PER_TOKEN + 1
    if isinstance(prompt[0], str):
        return sum(len(p) for p in prompt) // _CHARS_PER_TOKEN + 1
    if isinstance(prompt[0], int):
        return len(prompt)
    return sum(len(p) for p in prompt)


def prepare_completion(body: bytes, settings: Settings, models: Models) -> PreparedRequest:
    """Validate a text completion request and apply policy; raises InvalidRequestError / NotFoundError."""
    return _prepare(body, _COMPLETION, settings, models, _prompt_estimate)


_RESPONSES = _Route(
    schema=ResponsesRequest,
    budget_fields=("max_output_tokens",),
    bounds=BodyBounds(
        items_field="input",
        items=lambda data: count_entries(data, "input"),
        # Typed items carry a `"type"` but not always a `"role"`: the items are counted after parsing.
        entries=("input[].content", "tools", "metadata"),
        entry_marker=TYPE_MARKER,
    ),
    prompts=lambda data: 1,
    stream_options=False,
)
_MESSAGES_BOUNDS = BodyBounds(
    items_field="messages",
    items=lambda data: count_entries(data, "messages"),
    item_marker=ROLE_MARKER,
    entries=("messages[].content", "system", "tools", "stop_sequences"),
    entry_marker=TYPE_MARKER,
)
_MESSAGES = _Route(
    schema=AnthropicMessagesRequest,
    budget_fields=("max_tokens",),
    bounds=_MESSAGES_BOUNDS,
    prompts=lambda data: 1,
    stream_options=False,
)
# Counting tokens generates nothing (no prompt to complete): no token charge, and no place in the engine's queue.
_COUNT_TOKENS = _Route(
    schema=AnthropicCountTokensRequest,
    budget_fields=("max_tokens",),
    bounds=_MESSAGES_BOUNDS,
    prompts=lambda data: 0,
    stream_options=False,
)


def as_input_items(source: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A Responses `input` as a list of items: a string is one user message."""
    return [{"type": "message", "role": "user", "content": source}] if isinstance(source, str) else source


def prepare_responses(
    body: bytes,
    settings: Settings,
    models: Models,
    *,
    history: Sequence[dict[str, Any]] = (),
    background: bool = False,
) -> PreparedRequest:
    """Validate a Responses API request and apply policy: `instructions` is the system message for the default
    system message, `reasoning.effort` the reasoning switch. The engine keeps no state: a continued conversation's
    `history` (the stored chain's items, `api/conversation.py`) goes before the request's own input, in place of
    `previous_response_id`, and a `background` request goes as a stream the gateway reads. Raises
    InvalidRequestError / NotFoundError."""

    def policy(data: dict[str, Any]) -> int:
        data.pop("previous_response_id", None)
        data.pop("background", None)
        if background:
            data["stream"] = True
        if history:
            data["input"] = [*history, *as_input_items(data["input"])]
        if settings.inject_system_message and data.get("instructions") is None and not _has_system_item(data):
            data["instructions"] = settings.default_system_message
        apply_responses_reasoning(data, served_switch(settings.engine))
        text = _text_length(data.get("instructions"))
        source = data["input"]
        text += len(source) if isinstance(source, str) else sum(_item_text_length(item) for item in source)
        return text // _CHARS_PER_TOKEN + 1

    return _prepare(body, _RESPONSES, settings, models, policy)


def _item_text_length(item: dict[str, Any]) -> int:
    # A message's content, a function call's arguments, a call's output: what the engine reads of an item.
    extra = (item.get(field) for field in ("arguments", "output"))
    return _text_length(item.get("content")) + sum(len(value) for value in extra if isinstance(value, str))


def _has_system_item(data: dict[str, Any]) -> bool:
    source = data["input"]
    return isinstance(source, list) and any(item.get("role") in ("system", "developer") for item in source)


def _messages_policy(settings: Settings) -> Callable[[dict[str, Any]], int]:
    def policy(data: dict[str, Any]) -> int:
        if settings.inject_system_message and data.get("system") is None:
            data["system"] = settings.default_system_message
        text = _text_length(data.get("system")) + sum(_text_length(m.get("content")) for m in data["messages"])
        return text // _CHARS_PER_TOKEN + 1

    return policy


def _check_thinking_budget(data: dict[str, Any]) -> None:
    """vLLM refuses an enabled thinking budget of `max_tokens` or more (as Anthropic does): a 400 that says which
    budgets this request may have. Never rewritten: the nearest valid budget may be none (max_tokens up to 1024)."""
    thinking, max_tokens = data.get("thinking"), data["max_tokens"]
    budget = thinking.get("budget_tokens") if isinstance(thinking, dict) and thinking["type"] == "enabled" else None
    if budget is not None and budget >= max_tokens:
        valid = (
            f"send a budget from {MIN_THINKING_BUDGET} to {max_tokens - 1}"
            if max_tokens > MIN_THINKING_BUDGET
            else f"raise 'max_tokens' above {MIN_THINKING_BUDGET} (a budget is at least {MIN_THINKING_BUDGET})"
        )
        raise InvalidRequestError(
            f"'thinking.budget_tokens' is {budget}; it must be less than 'max_tokens' ({max_tokens}): {valid}.",
            param="thinking.budget_tokens",
        )


def prepare_messages(body: bytes, settings: Settings, models: Models) -> PreparedRequest:
    """Validate an Anthropic Messages request (a thinking budget below `max_tokens`) and apply the default system
    message (`system`)."""
    apply_policy = _messages_policy(settings)

    def policy(data: dict[str, Any]) -> int:
        _check_thinking_budget(data)
        return apply_policy(data)

    return _prepare(body, _MESSAGES, settings, models, policy)


def prepare_count_tokens(body: bytes, settings: Settings, models: Models) -> PreparedRequest:
    """Validate an Anthropic count_tokens request (as a Messages request would be counted)."""
    return _prepare(body, _COUNT_TOKENS, settings, models, _messages_policy(settings))
