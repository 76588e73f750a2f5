"""Wrong JSON types in every field of every relayed route's body: a 400 in the gateway's hands, never a crash.

For each route a body that uses every field its schema declares (nested ones included: message content parts,
tools, thinking, metadata, ...); each value in it, at every depth, is replaced by each JSON type in turn. What the
gateway checks itself (a field its schema declares) must be refused with the field named; what it passes on (a
field of the engine's) must reach the engine or be refused; nothing may raise anything else.
"""

from __future__ import annotations

import copy
import types
import typing
from collections.abc import Callable, Iterator
from typing import Any

import orjson
import pytest
from pydantic import BaseModel

from gateway.api.schemas import (
    AnthropicCountTokensRequest,
    AnthropicMessagesRequest,
    ChatCompletionRequest,
    CompletionRequest,
    ResponsesRequest,
)
from gateway.api.validation import (
    PreparedRequest,
    prepare_chat,
    prepare_completion,
    prepare_count_tokens,
    prepare_messages,
    prepare_responses,
)
from gateway.errors import GatewayError, InvalidRequestError
from gateway.relay.served_model import ModelInfo
from gateway.settings import Settings

pytestmark = pytest.mark.timeout(120)

MODEL = "nemotron-test"
INFO = ModelInfo(MODEL, 4096)
SETTINGS = Settings()
WRONG: tuple[Any, ...] = (None, True, 7, -1, 2.5, "text", "", [], {}, [1], ["text"], [{}], {"k": 1}, [None])
_TOOL_CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
_SAMPLING = {"n": 1, "best_of": 1, "seed": 1, "temperature": 0.5, "top_p": 0.5, "user": "u", "stop": ["x"]}
_PENALTIES = {"presence_penalty": 0.1, "frequency_penalty": 0.1, "logit_bias": {"1": 1.0}, "min_tokens": 1}
_STREAM = {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": False}}

Prepare = Callable[[bytes, Settings, ModelInfo], PreparedRequest]
ROUTES: dict[str, tuple[Prepare, type[BaseModel], dict[str, Any]]] = {
    "chat": (
        prepare_chat,
        ChatCompletionRequest,
        {
            "model": MODEL,
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "hi"}], "name": "n"},
                {"role": "assistant", "content": None, "tool_calls": [_TOOL_CALL]},
                {"role": "tool", "content": "x", "tool_call_id": "c1"},
            ],
            "max_tokens": 5,
            "max_completion_tokens": 5,
            "thinking_token_budget": 3,
            "logprobs": True,
            "top_logprobs": 1,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
            "response_format": {"type": "text"},
            "reasoning_effort": "low",
            "reasoning": {"enabled": True, "effort": "low"},
            "chat_template_kwargs": {"a": 1},
            "priority": 1,
            **_SAMPLING,
            **_PENALTIES,
            **_STREAM,
        },
    ),
    "completions": (
        prepare_completion,
        CompletionRequest,
        {
            "model": MODEL,
            "prompt": "hi",
            "max_tokens": 5,
            "max_completion_tokens": 5,
            "thinking_token_budget": 3,
            "echo": False,
            "logprobs": 1,
            "suffix": "s",
            "priority": 1,
            **_SAMPLING,
            **_PENALTIES,
            **_STREAM,
        },
    ),
    "responses": (
        prepare_responses,
        ResponsesRequest,
        {
            "model": MODEL,
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "x"}]},
                {"type": "function_call_output", "call_id": "c", "output": "o"},
            ],
            "instructions": "i",
            "max_output_tokens": 5,
            "stream": True,
            "store": True,
            "background": False,
            "previous_response_id": "resp_1",
            "temperature": 0.5,
            "top_p": 0.5,
            "reasoning": {"effort": "low", "summary": "auto"},
            "tools": [{"type": "function", "name": "f", "parameters": {}}],
            "metadata": {"a": "b"},
            "user": "u",
            "chat_template_kwargs": {"a": 1},
            "priority": 1,
        },
    ),
    "messages": (
        prepare_messages,
        AnthropicMessagesRequest,
        {
            "model": MODEL,
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "tool_result", "content": "r"}]},
                {"role": "assistant", "content": "x"},
            ],
            "system": [{"type": "text", "text": "s"}],
            "max_tokens": 2000,
            "stream": True,
            "temperature": 0.5,
            "top_p": 0.5,
            "top_k": 1,
            "stop_sequences": ["x"],
            "metadata": {"user_id": "u"},
            "tools": [{"name": "f", "description": "d", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "tool", "name": "f", "disable_parallel_tool_use": True},
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "priority": 1,
        },
    ),
    "count_tokens": (
        prepare_count_tokens,
        AnthropicCountTokensRequest,
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "system": "s",
            "tools": [{"name": "f", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "auto"},
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "max_tokens": 10,
        },
    ),
}


def _paths(value: Any, prefix: tuple[str | int, ...] = ()) -> Iterator[tuple[str | int, ...]]:
    if prefix:
        yield prefix
    children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in children:
        yield from _paths(child, (*prefix, key))


def _put(body: dict[str, Any], path: tuple[str | int, ...], value: Any) -> dict[str, Any]:
    changed = copy.deepcopy(body)
    target: Any = changed
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return changed


def _models_in(annotation: Any) -> list[Any]:
    """The pydantic models and list item types an annotation admits."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType, typing.Annotated):
        return [found for arg in typing.get_args(annotation) for found in _models_in(arg)]
    if origin is list:
        return [("list", typing.get_args(annotation)[0])]
    return []


def declared(schema: type[BaseModel], path: tuple[str | int, ...]) -> bool:
    """Whether the gateway's schema types the value at `path` itself (every step a declared field or list item)."""
    current: list[Any] = [schema]
    for step in path:
        following: list[Any] = []
        for kind in current:
            if isinstance(step, int) and isinstance(kind, tuple):
                following += _models_in(kind[1]) or [None]
            elif (
                isinstance(step, str)
                and isinstance(kind, type)
                and issubclass(kind, BaseModel)
                and step in kind.model_fields
            ):
                following += _models_in(kind.model_fields[step].annotation) or [None]
        if not following:
            return False
        current = following
    return True


def _json_kind(value: Any) -> str:
    return "number" if type(value) in (int, float) else type(value).__name__


def _cases() -> Iterator[tuple[str, tuple[str | int, ...], Any]]:
    for route, (_, _, body) in ROUTES.items():
        for path in _paths(body):
            for wrong in WRONG:
                yield route, path, wrong


def test_the_bodies_are_valid_and_use_every_declared_field() -> None:
    for prepare, schema, body in ROUTES.values():
        prepare(orjson.dumps(body), SETTINGS, INFO)
        assert set(schema.model_fields) <= set(body), set(schema.model_fields) - set(body)


@pytest.mark.parametrize("route", list(ROUTES))
def test_a_wrong_type_anywhere_is_a_4xx_or_goes_to_the_engine_never_a_crash(route: str) -> None:
    prepare, schema, body = ROUTES[route]
    unchecked = []
    for path in _paths(body):
        here: Any = body
        for key in path:
            here = here[key]
        for wrong in WRONG:
            try:
                prepare(orjson.dumps(_put(body, path, wrong)), SETTINGS, INFO)
            except GatewayError as exc:
                assert 400 <= exc.status_code < 500, (path, wrong, exc.message)
                continue
            # Accepted: a value of the type it had (or a null for an optional field), or one the engine checks.
            if _json_kind(wrong) != _json_kind(here) and declared(schema, path) and not isinstance(here, dict | list):
                unchecked.append((path, wrong))
    # A scalar the gateway's schema declares takes no other JSON type than its own, save null where optional
    # and the documented alternatives (`stop`, `content`, `input`, `system`, `prompt` take a string or a list).
    alternatives = {"stop", "content", "input", "system", "prompt"}
    wrongly_accepted = [
        (path, wrong)
        for path, wrong in unchecked
        if wrong is not None
        and not (path[-1] in alternatives or (path[-1] == "text" and wrong is None))
        and not (isinstance(wrong, int | float) and not isinstance(wrong, bool) and _is_number_field(schema, path))
    ]
    assert not wrongly_accepted, wrongly_accepted


def _is_number_field(schema: type[BaseModel], path: tuple[str | int, ...]) -> bool:
    # JSON has one number type: a float field takes 7, an int field is checked strictly.
    here: Any = ROUTES_BY_SCHEMA[schema]
    for key in path:
        here = here[key]
    return isinstance(here, float)


ROUTES_BY_SCHEMA = {schema: body for _, schema, body in ROUTES.values()}


@pytest.mark.parametrize(
    ("route", "path", "wrong"),
    [
        ("responses", ("input", 0, "content", 0, "text"), 7),
        ("count_tokens", ("max_tokens",), "many"),
        ("count_tokens", ("max_tokens",), [1]),
        ("messages", ("tools", 0, "input_schema"), "object"),
        ("messages", ("tool_choice", "type"), "sometimes"),
        ("messages", ("thinking", "budget_tokens"), "1024"),
        ("messages", ("metadata", "user_id"), 7),
    ],
)
def test_the_fields_that_crashed_or_reached_the_engine_untyped_are_400s_naming_them(
    route: str, path: tuple[str | int, ...], wrong: Any
) -> None:
    prepare, _, body = ROUTES[route]
    with pytest.raises(InvalidRequestError) as caught:
        prepare(orjson.dumps(_put(body, path, wrong)), SETTINGS, INFO)
    expected = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")
    assert caught.value.param == expected, caught.value.message
