"""prepare_chat / prepare_completion: every pitfall is a 400 that names the field and what to send instead."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from gateway.api.bounds import BodyBounds, count_entries
from gateway.api.validation import (
    PreparedRequest,
    param_path,
    prepare_chat,
    prepare_completion,
    prepare_count_tokens,
    prepare_messages,
    prepare_responses,
)
from gateway.errors import InvalidRequestError, NotFoundError
from gateway.relay.served_model import ModelInfo
from gateway.settings import DEFAULT_SYSTEM_MESSAGE, EngineSettings, Settings

pytestmark = pytest.mark.timeout(5)

MODEL = "nemotron-test"
INFO = ModelInfo(MODEL, 4096)
SETTINGS = Settings(model_aliases=("nemotron", "gpt-3.5-turbo"), max_n=4)
USER = {"role": "user", "content": "Hello"}
SYSTEM = {"role": "system", "content": "Answer in French."}


def chat_body(**fields: Any) -> bytes:
    return orjson.dumps({"model": MODEL, "messages": [USER], **fields})


def completion_body(**fields: Any) -> bytes:
    return orjson.dumps({"model": MODEL, "prompt": "Once upon a time", **fields})


def chat(body: bytes, settings: Settings = SETTINGS) -> tuple[PreparedRequest, dict[str, Any]]:
    prepared = prepare_chat(body, settings, INFO)
    return prepared, orjson.loads(prepared.body)


def completion(body: bytes, settings: Settings = SETTINGS) -> tuple[PreparedRequest, dict[str, Any]]:
    prepared = prepare_completion(body, settings, INFO)
    return prepared, orjson.loads(prepared.body)


def rejected(body: bytes, *, completions: bool = False) -> InvalidRequestError:
    prepare = prepare_completion if completions else prepare_chat
    with pytest.raises(InvalidRequestError) as caught:
        prepare(body, SETTINGS, INFO)
    error = caught.value
    assert error.status_code == 400
    assert error.type == "invalid_request_error"
    return error


# --- the body itself -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "phrase"),
    [
        (b'{"model": "nemotron-test", "messages": [', "not valid JSON"),
        (b"{'model': 'nemotron-test'}", "not valid JSON"),
        (b"", "empty"),
        (b"  \r\n\t", "empty"),
        (b'[{"role": "user", "content": "hi"}]', "must be a JSON object"),
        (b'"hello"', "must be a JSON object"),
        (b"42", "must be a JSON object"),
        (b"null", "must be a JSON object"),
    ],
    ids=["truncated", "single-quotes", "empty", "whitespace", "list", "string", "number", "null"],
)
@pytest.mark.parametrize("completions", [False, True], ids=["chat", "completions"])
def test_body_must_be_a_json_object(body: bytes, phrase: str, completions: bool) -> None:
    error = rejected(body, completions=completions)
    assert phrase in error.message
    assert "send a JSON object" in error.message or 'send {"model"' in error.message
    assert error.param is None


# --- required fields -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "param"),
    [
        ({"messages": [USER]}, "model"),
        ({"model": MODEL}, "messages"),
        ({"model": MODEL, "messages": [{"content": "no role"}]}, "messages[0].role"),
    ],
)
def test_missing_required_field(data: dict[str, Any], param: str) -> None:
    error = rejected(orjson.dumps(data))
    assert error.param == param
    assert error.message == f"Missing required parameter '{param}'."


def test_missing_prompt() -> None:
    error = rejected(orjson.dumps({"model": MODEL}), completions=True)
    assert error.param == "prompt"
    assert "Missing required parameter 'prompt'" in error.message


def test_empty_messages() -> None:
    error = rejected(chat_body(messages=[]))
    assert error.param == "messages"
    assert "send at least one message" in error.message


def test_model_must_be_a_string() -> None:
    error = rejected(chat_body(model=5))
    assert error.param == "model"
    assert "send a string" in error.message


# --- roles and content -----------------------------------------------------------------------------


@pytest.mark.parametrize("role", ["User", "Developer", 5, "SYSTEM", ""], ids=repr)
def test_invalid_role_names_the_message_and_lists_valid_roles(role: Any) -> None:
    error = rejected(chat_body(messages=[SYSTEM, {"role": role, "content": "hi"}]))
    assert error.param == "messages[1].role"
    assert f"Invalid role {role!r}" in error.message
    assert "'system', 'developer', 'user', 'assistant', 'tool'" in error.message
    assert "lowercase" in error.message


@pytest.mark.parametrize("role", ["user", "system", "tool"])
@pytest.mark.parametrize("content", [5, 1.5, True, {"text": "hi"}], ids=["int", "float", "bool", "dict"])
def test_content_must_be_a_string_or_parts(role: str, content: Any) -> None:
    message: dict[str, Any] = {"role": role, "content": content}
    if role == "tool":
        message["tool_call_id"] = "call_1"
    error = rejected(chat_body(messages=[USER, message]))
    assert error.param == "messages[1].content"
    assert "content must be a string or a list of content parts" in error.message
    assert "{'type': 'text', 'text': '...'}" in error.message


@pytest.mark.parametrize("role", ["user", "system", "tool"])
def test_content_is_required_except_for_assistant_tool_calls(role: str) -> None:
    error = rejected(chat_body(messages=[{"role": role}]))
    assert error.param is not None and error.param.startswith("messages[0]")
    assert "content is required" in error.message


def test_assistant_with_tool_calls_and_no_content_is_accepted() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        USER,
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
    ]
    _, out = chat(chat_body(messages=messages))
    assert out["messages"][1:] == messages


def test_assistant_without_content_or_tool_calls_is_rejected() -> None:
    error = rejected(chat_body(messages=[USER, {"role": "assistant"}]))
    assert error.param is not None and error.param.startswith("messages[1]")
    assert "content is required" in error.message


def test_content_as_list_of_text_parts_is_accepted() -> None:
    parts = [{"type": "text", "text": "Describe "}, {"type": "text", "text": "this."}]
    prepared, out = chat(chat_body(messages=[{"role": "user", "content": parts}]))
    assert out["messages"][-1]["content"] == parts
    # The parts' text counts towards the prompt estimate like a plain string would.
    plain, _ = chat(chat_body(messages=[{"role": "user", "content": "Describe this."}]))
    assert prepared.prompt_tokens_estimate == plain.prompt_tokens_estimate


@pytest.mark.parametrize(
    "part",
    [{"type": "text"}, {"type": "text", "text": 5}, {"type": "text", "text": None}],
    ids=["no-text", "text-number", "text-null"],
)
def test_text_part_without_string_text_is_rejected(part: dict[str, Any]) -> None:
    error = rejected(chat_body(messages=[{"role": "user", "content": [part]}]))
    # The part is at fault, not "content is not a string": point at the part and say what it lacks.
    assert error.param is not None and error.param.startswith("messages[0].content[0]"), error.param
    assert "text" in error.message.split(":", 1)[1] or error.param.endswith(".text"), error.message
    assert "string" in error.message, error.message


# --- sampling fields -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "phrase"),
    [
        ("max_tokens", 0, "greater than or equal to 1"),
        ("max_tokens", -1, "greater than or equal to 1"),
        ("max_tokens", "10", "send a whole number"),
        ("max_tokens", 1.5, "send a whole number"),
        ("max_tokens", True, "send a whole number"),
        ("max_completion_tokens", 0, "greater than or equal to 1"),
        ("max_completion_tokens", "10", "send a whole number"),
        ("n", 0, "greater than or equal to 1"),
        ("n", "2", "send a whole number"),
        ("temperature", "hot", "send a number"),
        ("temperature", 3, "less than or equal to 2"),
        ("temperature", -0.1, "greater than or equal to 0"),
        ("top_p", 1.5, "less than or equal to 1"),
        ("stream", "yes", "send true or false"),
        ("stream", 1, "send true or false"),
        ("stop", 5, "stop must be a string or a list of strings"),
        ("stop", [1], "stop must be a string or a list of strings"),
        ("stop", ["ok", None], "stop must be a string or a list of strings"),
    ],
)
def test_bad_sampling_field(field: str, value: Any, phrase: str) -> None:
    error = rejected(chat_body(**{field: value}))
    assert error.param == field
    assert phrase in error.message
    assert error.message.startswith(f"Invalid value for '{field}'")


@pytest.mark.parametrize(
    ("field", "value", "phrase"),
    [
        ("max_tokens", "10", "send a whole number"),
        ("stream", "yes", "send true or false"),
        ("stop", 5, "list of strings"),
    ],
)
def test_bad_sampling_field_on_completions(field: str, value: Any, phrase: str) -> None:
    error = rejected(completion_body(**{field: value}), completions=True)
    assert error.param == field
    assert phrase in error.message


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_completion_budget_beyond_context_length(field: str) -> None:
    error = rejected(chat_body(**{field: 4097}))
    assert error.param == field
    assert "4097" in error.message and "context length of 4096" in error.message
    assert "send at most 4096" in error.message


def test_max_tokens_beyond_context_length_on_completions() -> None:
    error = rejected(completion_body(max_tokens=10_000), completions=True)
    assert error.param == "max_tokens"
    assert "send at most 4096" in error.message


def test_max_tokens_equal_to_context_length_is_accepted() -> None:
    prepared, _ = chat(chat_body(max_tokens=4096))
    assert prepared.max_tokens == 4096


def test_unknown_context_length_does_not_bound_max_tokens() -> None:
    prepared = prepare_chat(chat_body(max_tokens=1_000_000), SETTINGS, ModelInfo(MODEL, None))
    assert prepared.max_tokens == 1_000_000


@pytest.mark.parametrize(
    ("fields", "sent"),
    [
        ({"max_tokens": 64, "thinking_token_budget": 1000}, 64),  # above the request's own max tokens: cut to them
        ({"thinking_token_budget": 2**40}, 4096),  # no max tokens: the context length bounds it
        ({"max_tokens": 64, "thinking_token_budget": 32}, 32),  # within: as sent
        ({"max_tokens": 64, "thinking_token_budget": -1}, -1),  # vLLM's "no budget"
    ],
)
def test_a_thinking_budget_above_the_max_tokens_is_clamped(fields: dict[str, Any], sent: int) -> None:
    assert chat(chat_body(**fields))[1]["thinking_token_budget"] == sent
    assert completion(completion_body(**fields))[1]["thinking_token_budget"] == sent


def test_the_chat_budget_the_engine_uses_bounds_the_thinking_budget() -> None:
    body = chat_body(max_completion_tokens=64, max_tokens=4000, thinking_token_budget=1000)
    assert chat(body)[1]["thinking_token_budget"] == 64  # vLLM prefers max_completion_tokens


def _messages_thinking(max_tokens: int, budget: Any) -> bytes:
    thinking = {"type": "enabled", "budget_tokens": budget}
    return orjson.dumps({"model": MODEL, "messages": [USER], "max_tokens": max_tokens, "thinking": thinking})


@pytest.mark.parametrize(
    ("max_tokens", "budget", "hint"),
    [
        (2000, 5000, "send a budget from 1024 to 1999"),
        (2000, 2000, "send a budget from 1024 to 1999"),
        (64, 5000, "raise 'max_tokens' above 1024"),
    ],
)
def test_an_anthropic_thinking_budget_from_max_tokens_is_a_400_saying_which_budgets_are_valid(
    max_tokens: int, budget: int, hint: str
) -> None:
    # vLLM refuses a budget of max_tokens or more; cutting it to max_tokens made a body it must refuse.
    with pytest.raises(InvalidRequestError) as caught:
        prepare_messages(_messages_thinking(max_tokens, budget), SETTINGS, INFO)
    assert caught.value.param == "thinking.budget_tokens"
    assert hint in caught.value.message and f"less than 'max_tokens' ({max_tokens})" in caught.value.message


@pytest.mark.parametrize("budget", [1023, 0, "2000", 1.5, None])
def test_an_anthropic_thinking_budget_is_a_whole_number_from_1024(budget: Any) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        prepare_messages(_messages_thinking(4000, budget), SETTINGS, INFO)
    assert caught.value.param in ("thinking.budget_tokens", "thinking")


def test_a_valid_anthropic_thinking_budget_goes_to_the_engine_as_sent() -> None:
    sent = orjson.loads(prepare_messages(_messages_thinking(2000, 1999), SETTINGS, INFO).body)
    assert sent["thinking"] == {"type": "enabled", "budget_tokens": 1999}


@pytest.mark.parametrize("budget", [-2, 1.5, "100", True])
def test_a_thinking_budget_that_is_not_a_whole_number_from_minus_one(budget: Any) -> None:
    error = rejected(chat_body(thinking_token_budget=budget))
    assert error.param == "thinking_token_budget"


def test_n_above_the_gateway_limit() -> None:
    error = rejected(chat_body(n=5))
    assert error.param == "n"
    assert "at most 4" in error.message
    assert chat(chat_body(n=4))[1]["n"] == 4


@pytest.mark.parametrize("stream", [False, "absent"])
def test_stream_options_without_stream(stream: Any) -> None:
    fields: dict[str, Any] = {"stream_options": {"include_usage": True}}
    if stream != "absent":
        fields["stream"] = stream
    error = rejected(chat_body(**fields))
    assert error.param == "stream_options"
    assert '"stream": true' in error.message


def test_stream_null_means_not_streaming() -> None:
    # OpenAI documents `stream` as "boolean or null" and vLLM accepts null; SDKs and proxies send it.
    prepared, _ = chat(chat_body(stream=None))
    assert prepared.stream is False


def test_stream_options_fields_are_typed() -> None:
    error = rejected(chat_body(stream=True, stream_options={"include_usage": "yes"}))
    assert error.param == "stream_options.include_usage"
    assert "send true or false" in error.message


# --- the model -------------------------------------------------------------------------------------


@pytest.mark.parametrize("prepare", [prepare_chat, prepare_completion], ids=["chat", "completions"])
def test_unknown_model_is_404_naming_the_served_model(prepare: Any) -> None:
    body = chat_body(model="gpt-4") if prepare is prepare_chat else completion_body(model="gpt-4")
    with pytest.raises(NotFoundError) as caught:
        prepare(body, SETTINGS, INFO)
    error = caught.value
    assert (error.status_code, error.param, error.code) == (404, "model", "model_not_found")
    assert "'gpt-4'" in error.message
    assert f"'{MODEL}'" in error.message and "'nemotron'" in error.message


@pytest.mark.parametrize("alias", ["nemotron", "gpt-3.5-turbo"])
def test_alias_is_rewritten_to_the_served_name(alias: str) -> None:
    prepared, out = chat(chat_body(model=alias))
    assert prepared.model == MODEL
    assert out["model"] == MODEL
    cprepared, cout = completion(completion_body(model=alias))
    assert cprepared.model == MODEL and cout["model"] == MODEL


def test_served_name_is_kept() -> None:
    prepared, out = chat(chat_body())
    assert prepared.model == out["model"] == MODEL


def test_model_name_is_case_sensitive() -> None:
    with pytest.raises(NotFoundError):
        prepare_chat(chat_body(model=MODEL.upper()), SETTINGS, INFO)


# --- pass-through and policy -----------------------------------------------------------------------


def test_unknown_fields_pass_through_untouched() -> None:
    extra = {
        "top_k": 40,
        "repetition_penalty": 1.05,
        "chat_template_kwargs": {"enable_thinking": False, "nested": [1, {"a": None}]},
        "guided_json": {"type": "object"},
        "temperature": 0.7,
    }
    _, out = chat(chat_body(**extra))
    for key, value in extra.items():
        assert out[key] == value
    _, cout = completion(completion_body(**extra))
    for key, value in extra.items():
        assert cout[key] == value


def test_default_system_message_injected_first_when_absent() -> None:
    messages = [USER, {"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "More"}]
    _, out = chat(chat_body(messages=messages))
    assert out["messages"] == [{"role": "system", "content": DEFAULT_SYSTEM_MESSAGE}, *messages]


def test_configured_system_message_is_the_one_injected() -> None:
    settings = Settings(default_system_message="detailed thinking off")
    _, out = chat(chat_body(), settings)
    assert out["messages"][0] == {"role": "system", "content": "detailed thinking off"}


@pytest.mark.parametrize("position", [0, 1])
def test_no_system_message_injected_when_one_is_present(position: int) -> None:
    messages = [USER, {"role": "assistant", "content": "Hi!"}]
    messages.insert(position, SYSTEM)
    _, out = chat(chat_body(messages=messages))
    assert out["messages"] == messages


def test_no_system_message_injected_when_disabled() -> None:
    _, out = chat(chat_body(), Settings(inject_system_message=False))
    assert out["messages"] == [USER]


def test_non_stream_request_is_left_without_stream_options() -> None:
    prepared, out = chat(chat_body())
    assert prepared.stream is False and prepared.client_wants_usage is False
    assert "stream_options" not in out


@pytest.mark.parametrize(
    "options",
    [None, {}, {"include_usage": False}, {"include_usage": None}],
    ids=["absent", "empty", "false", "null"],
)
@pytest.mark.parametrize("prepare", [chat, completion], ids=["chat", "completions"])
def test_stream_forces_usage_for_accounting(options: dict[str, Any] | None, prepare: Any) -> None:
    fields: dict[str, Any] = {"stream": True}
    if options is not None:
        fields["stream_options"] = options
    body = chat_body(**fields) if prepare is chat else completion_body(**fields)
    prepared, out = prepare(body)
    assert prepared.stream is True
    assert prepared.client_wants_usage is False
    assert out["stream_options"]["include_usage"] is True


def test_stream_usage_kept_when_the_client_asked() -> None:
    prepared, out = chat(chat_body(stream=True, stream_options={"include_usage": True}))
    assert prepared.client_wants_usage is True
    assert out["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize("include_usage", [True, False])
def test_other_stream_options_are_preserved(include_usage: bool) -> None:
    options = {"include_usage": include_usage, "continuous_usage_stats": True, "vendor_flag": "x"}
    prepared, out = chat(chat_body(stream=True, stream_options=options))
    assert prepared.client_wants_usage is include_usage
    assert out["stream_options"] == {**options, "include_usage": True}


# --- completions -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "estimate", "prompts"),
    [
        ("abcdefgh", 8 // 4 + 1, 1),
        (["abcd", "efghijkl"], 12 // 4 + 1, 2),
        ([101, 102, 103], 3, 1),
        ([[101, 102], [103, 104, 105]], 5, 2),
    ],
    ids=["str", "list-str", "token-ids", "batch-token-ids"],
)
def test_prompt_forms_are_accepted_and_estimated(prompt: Any, estimate: int, prompts: int) -> None:
    prepared, out = completion(completion_body(prompt=prompt, max_tokens=100))
    assert out["prompt"] == prompt
    assert prepared.prompt_tokens_estimate == estimate
    # Each prompt of a batch gets its own completion, and each is charged.
    assert prepared.tokens_estimate == estimate + 100 * prompts


@pytest.mark.parametrize(
    "prompt",
    ["", [], [1, "a"], {}, [""], [[]], [True, 1], [1.5], None, 5],
    ids=[
        "empty-str",
        "empty-list",
        "mixed",
        "object",
        "list-empty-str",
        "empty-batch",
        "bools",
        "floats",
        "null",
        "int",
    ],
)
def test_bad_prompt_forms_are_rejected(prompt: Any) -> None:
    error = rejected(completion_body(prompt=prompt), completions=True)
    assert error.param == "prompt"
    assert "prompt must be a non-empty string, a list of non-empty strings, a list of token ids" in error.message


def test_chat_tokens_estimate_is_prompt_estimate_plus_max_tokens() -> None:
    with_budget, _ = chat(chat_body(max_tokens=300))
    assert with_budget.max_tokens == 300
    assert with_budget.tokens_estimate == with_budget.prompt_tokens_estimate + 300
    longer, _ = chat(chat_body(messages=[{"role": "user", "content": "x" * 4000}], max_tokens=300))
    assert longer.prompt_tokens_estimate >= 1000
    assert longer.tokens_estimate == longer.prompt_tokens_estimate + 300


def test_max_completion_tokens_is_the_budget_when_given() -> None:
    prepared, _ = chat(chat_body(max_completion_tokens=50, max_tokens=10))
    assert prepared.max_tokens == 50
    assert prepared.tokens_estimate == prepared.prompt_tokens_estimate + 50


def test_tokens_estimate_without_max_tokens_still_charges_a_completion() -> None:
    prepared, _ = completion(completion_body(prompt=[1, 2, 3]))
    assert prepared.max_tokens is None
    assert prepared.tokens_estimate > prepared.prompt_tokens_estimate


@pytest.mark.parametrize(
    ("loc", "path"),
    [(("model",), "model"), (("messages", 1, "role"), "messages[1].role"), (("a", 0, 2, "b"), "a[0][2].b")],
)
def test_param_path(loc: tuple[int | str, ...], path: str) -> None:
    assert param_path(loc) == path


# --- hostile bodies --------------------------------------------------------------------------------

TOKEN_FIELDS = [
    ("max_tokens", -1),
    ("max_tokens", 0),
    ("max_tokens", "100"),
    ("max_tokens", 1.5),
    ("max_tokens", True),
    ("max_tokens", 1e20),  # what orjson makes of an integer beyond 64 bits
    ("max_completion_tokens", -5),
    ("max_completion_tokens", "5"),
    ("max_completion_tokens", [5]),
    ("min_tokens", -1),
    ("min_tokens", "1"),
    ("n", 0),
    ("n", -2),
    ("n", "2"),
]


@pytest.mark.parametrize(("field", "value"), TOKEN_FIELDS, ids=lambda v: repr(v))
@pytest.mark.parametrize("completions", [False, True], ids=["chat", "completions"])
def test_every_token_count_field_is_a_positive_whole_number(field: str, value: Any, completions: bool) -> None:
    body = completion_body(**{field: value}) if completions else chat_body(**{field: value})
    error = rejected(body, completions=completions)
    assert error.param == field


@pytest.mark.parametrize(
    ("field", "value"),
    [("best_of", 0), ("best_of", "2"), ("logprobs", -1), ("logprobs", 21), ("logprobs", "3")],
    ids=lambda v: repr(v),
)
def test_completion_choice_and_logprob_fields_are_bounded(field: str, value: Any) -> None:
    assert rejected(completion_body(**{field: value}), completions=True).param == field


@pytest.mark.parametrize(("field", "value"), [("top_logprobs", -1), ("top_logprobs", 21), ("logprobs", 3)])
def test_chat_logprob_fields_are_bounded(field: str, value: Any) -> None:
    assert rejected(chat_body(**{field: value})).param == field


def test_best_of_below_n_or_above_the_cap_is_refused() -> None:
    assert rejected(completion_body(n=3, best_of=2), completions=True).param == "best_of"
    assert rejected(completion_body(best_of=SETTINGS.max_n + 1), completions=True).param == "best_of"


@pytest.mark.parametrize("prompt", [[1, -2, 3], [[1, 2], [-1]], [2**40], [[2**31]]], ids=str)
def test_negative_or_huge_token_ids_are_refused(prompt: Any) -> None:
    error = rejected(completion_body(prompt=prompt), completions=True)
    assert error.param == "prompt"
    assert "token ids" in error.message


def test_the_up_front_charge_counts_every_choice() -> None:
    single, _ = chat(chat_body(max_tokens=100))
    assert single.tokens_estimate == single.prompt_tokens_estimate + 100
    several, _ = chat(chat_body(max_completion_tokens=100, n=3))
    assert several.tokens_estimate == several.prompt_tokens_estimate + 300
    best, _ = completion(completion_body(max_tokens=10, n=2, best_of=4))
    assert best.tokens_estimate == best.prompt_tokens_estimate + 40
    batch, _ = completion(completion_body(prompt=["a", "b", "c"], max_tokens=10, n=2))
    assert batch.tokens_estimate == batch.prompt_tokens_estimate + 60


def test_completions_are_charged_by_max_tokens_the_field_the_engine_reads() -> None:
    prepared, _ = completion(completion_body(max_tokens=7, max_completion_tokens=100))
    assert prepared.max_tokens == 7


def nested(depth: int) -> Any:
    value: Any = "x"
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("completions", [False, True], ids=["chat", "completions"])
@pytest.mark.parametrize("depth", [300, 1000])
def test_nesting_the_serialiser_refuses_is_a_400(depth: int, completions: bool) -> None:
    # orjson parses up to 1024 levels but serialises only ~254: before, this was a 500.
    raw = b'{"vllm_xargs": ' + b"[" * depth + b"1" + b"]" * depth + b"}"
    base = completion_body() if completions else chat_body()
    body = base[:-1] + b"," + raw[1:]
    error = rejected(body, completions=completions)
    assert "nested too deeply" in error.message


def test_nesting_the_serialiser_accepts_passes_through() -> None:
    _, out = chat(chat_body(extra=nested(200)))
    assert out["extra"] == nested(200)


def test_too_many_messages_are_refused_before_they_are_checked() -> None:
    settings = Settings(max_messages=10)
    # Invalid messages: had they been validated first, the error would name messages[0].role.
    body = orjson.dumps({"model": MODEL, "messages": [{"role": "User", "content": "x"}] * 11})
    with pytest.raises(InvalidRequestError) as caught:
        prepare_chat(body, settings, INFO)
    assert caught.value.param == "messages"
    assert "at most 10" in caught.value.message
    prepared = prepare_chat(orjson.dumps({"model": MODEL, "messages": [USER] * 10}), settings, INFO)
    assert prepared.model == MODEL


def test_too_many_messages_are_refused_before_the_body_is_parsed() -> None:
    settings = Settings(max_messages=10)
    # Not even valid JSON at the end: the count comes first.
    body = orjson.dumps({"model": MODEL, "messages": [USER] * 11})[:-5]
    with pytest.raises(InvalidRequestError) as caught:
        prepare_chat(body, settings, INFO)
    assert caught.value.param == "messages"


def test_role_keys_spelt_with_escapes_are_still_counted_after_parsing() -> None:
    settings = Settings(max_messages=10)
    body = orjson.dumps({"model": MODEL, "messages": [USER] * 11}).replace(b'"role"', b'"r\\u006fle"')
    with pytest.raises(InvalidRequestError) as caught:
        prepare_chat(body, settings, INFO)
    assert caught.value.param == "messages"
    assert "at most 10" in caught.value.message


def test_a_batch_of_prompts_counts_against_the_message_cap_but_token_ids_do_not() -> None:
    settings = Settings(max_messages=3)
    with pytest.raises(InvalidRequestError) as caught:
        prepare_completion(completion_body(prompt=["a", "b", "c", "d"]), settings, INFO)
    assert caught.value.param == "prompt"
    prepare_completion(completion_body(prompt=list(range(100))), settings, INFO)


# --- every field the gateway reads is typed --------------------------------------------------------

_texts = st.text(max_size=6)
_ints = st.integers(min_value=-(2**63), max_value=2**63 - 1)
_floats = st.floats(allow_nan=False, allow_infinity=False).filter(lambda value: not value.is_integer())
_lists = st.lists(_ints | _texts | st.none(), min_size=1, max_size=3)
_objects = st.dictionaries(_texts, _ints | _texts, min_size=1, max_size=3)
NOT_AN_INT = _texts | _floats | st.booleans() | _lists | _objects
NOT_A_BOOL = _texts | _ints | _floats | _lists | _objects
NOT_A_NUMBER = _texts | st.booleans() | _lists | _objects
NOT_A_STRING = _ints | _floats | st.booleans() | _lists | _objects
NOT_AN_OBJECT = _texts | _ints | _floats | st.booleans() | st.lists(_objects, min_size=1, max_size=2)
NOT_A_LIST_OF_OBJECTS = _texts | _ints | _floats | st.booleans() | _objects | _lists
NOT_STRINGS = NOT_A_STRING.filter(lambda v: not (isinstance(v, list) and all(isinstance(s, str) for s in v)))
# Not a string, strings, token ids or lists of token ids.
NOT_A_PROMPT = _ints | _floats | st.booleans() | _objects | st.lists(st.none() | st.booleans() | _floats, min_size=1)
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


def _field(name: str) -> Callable[[Any], dict[str, Any]]:
    return lambda value: {name: value}


def _message(**fields: Any) -> Callable[[Any], dict[str, Any]]:
    # The field to fill is the one whose value is Ellipsis.
    return lambda value: {"messages": [{k: value if v is ... else v for k, v in fields.items()}]}


def _part(**fields: Any) -> Callable[[Any], dict[str, Any]]:
    return lambda value: {
        "messages": [{"role": "system", "content": [{k: value if v is ... else v for k, v in fields.items()}]}]
    }


# (wrong values, the body fields holding one, the param the 400 must name): every field validation, policy,
# reasoning and the limits read, and the fields they read inside it.
CHAT_FIELDS: list[tuple[st.SearchStrategy[Any], Callable[[Any], dict[str, Any]], str]] = [
    *((NOT_AN_INT, _field(f), f) for f in ("n", "best_of", "max_tokens", "max_completion_tokens", "min_tokens")),
    *((NOT_AN_INT, _field(f), f) for f in ("seed", "top_logprobs")),
    *((NOT_A_NUMBER, _field(f), f) for f in ("temperature", "top_p", "presence_penalty", "frequency_penalty")),
    (NOT_A_BOOL, _field("stream"), "stream"),
    (NOT_A_BOOL, _field("logprobs"), "logprobs"),
    (NOT_AN_OBJECT, lambda v: {"stream": True, "stream_options": v}, "stream_options"),
    (NOT_A_BOOL, lambda v: {"stream": True, "stream_options": {"include_usage": v}}, "stream_options.include_usage"),
    (NOT_A_STRING, _field("model"), "model"),
    (NOT_A_STRING, _field("user"), "user"),
    (NOT_STRINGS, _field("stop"), "stop"),
    (NOT_A_LIST_OF_OBJECTS, _field("messages"), "messages"),
    (NOT_A_STRING, _message(role=..., content="x"), "messages[0].role"),
    (NOT_A_STRING.filter(lambda v: not isinstance(v, list)), _message(role="user", content=...), "messages[0].content"),
    (_lists, _message(role="user", content=...), "messages[0].content"),
    (NOT_A_STRING, _message(role="user", content="x", name=...), "messages[0].name"),
    (NOT_A_LIST_OF_OBJECTS, _message(role="assistant", tool_calls=...), "messages[0].tool_calls"),
    (NOT_A_STRING, _message(role="tool", content="x", tool_call_id=...), "messages[0].tool_call_id"),
    (NOT_A_STRING, _part(type=..., text="x"), "messages[0].content[0]"),
    (NOT_A_STRING, _part(type="text", text=...), "messages[0].content[0]"),
    (NOT_A_STRING | _texts.filter(lambda t: t not in EFFORTS), _field("reasoning_effort"), "reasoning_effort"),
    (NOT_AN_OBJECT, _field("reasoning"), "reasoning"),
    (NOT_A_BOOL, lambda v: {"reasoning": {"enabled": v}}, "reasoning.enabled"),
    (NOT_A_STRING, lambda v: {"reasoning": {"effort": v}}, "reasoning.effort"),
    (NOT_AN_OBJECT, _field("chat_template_kwargs"), "chat_template_kwargs"),
    (NOT_A_LIST_OF_OBJECTS, _field("tools"), "tools"),
    (NOT_AN_OBJECT, _field("response_format"), "response_format"),
    (NOT_AN_OBJECT, _field("logit_bias"), "logit_bias"),
    (NOT_A_NUMBER, lambda v: {"logit_bias": {"50256": v}}, "logit_bias"),
]
COMPLETION_FIELDS: list[tuple[st.SearchStrategy[Any], Callable[[Any], dict[str, Any]], str]] = [
    *((NOT_AN_INT, _field(f), f) for f in ("n", "best_of", "max_tokens", "min_tokens", "logprobs", "seed")),
    (NOT_A_BOOL, _field("echo"), "echo"),
    (NOT_A_BOOL, _field("stream"), "stream"),
    (NOT_A_STRING, _field("suffix"), "suffix"),
    (NOT_A_STRING, _field("model"), "model"),
    (NOT_A_PROMPT, _field("prompt"), "prompt"),
    (NOT_STRINGS, _field("stop"), "stop"),
    (NOT_AN_OBJECT, _field("logit_bias"), "logit_bias"),
]
# Each preset's reasoning switch takes its own path through the policy code.
PRESETS = ("generic", "nemotron-3-nano", "nemotron-nano-9b-v2", "llama-nemotron-nano-8b")
TYPED = hypothesis_settings(max_examples=30, deadline=None, derandomize=True)


def _refused_naming(prepare: Any, body: dict[str, Any], param: str, preset: str) -> None:
    settings = Settings(max_n=4, engine=EngineSettings(preset=preset))
    try:
        prepare(orjson.dumps(body), settings, INFO)
    except InvalidRequestError as error:
        envelope = error.to_openai_body()["error"]
        assert (error.status_code, envelope["type"]) == (400, "invalid_request_error"), envelope
        assert envelope["param"] is not None and envelope["param"].startswith(param), (body, envelope)
        return
    raise AssertionError(f"accepted {body!r}")


@pytest.mark.parametrize(("values", "build", "param"), CHAT_FIELDS, ids=[c[2] for c in CHAT_FIELDS])
@TYPED
@given(data=st.data())
def test_a_wrong_type_in_any_chat_field_is_a_400_naming_it(
    values: st.SearchStrategy[Any], build: Callable[[Any], dict[str, Any]], param: str, data: st.DataObject
) -> None:
    value = data.draw(values)
    preset = data.draw(st.sampled_from(PRESETS))
    switch = data.draw(st.sampled_from([{}, {"reasoning_effort": "none"}, {"stream": True}]))
    body = {"model": MODEL, "messages": [SYSTEM, USER], **switch, **build(value)}
    _refused_naming(prepare_chat, body, param, preset)


@pytest.mark.parametrize(("values", "build", "param"), COMPLETION_FIELDS, ids=[c[2] for c in COMPLETION_FIELDS])
@TYPED
@given(data=st.data())
def test_a_wrong_type_in_any_completion_field_is_a_400_naming_it(
    values: st.SearchStrategy[Any], build: Callable[[Any], dict[str, Any]], param: str, data: st.DataObject
) -> None:
    body = {"model": MODEL, "prompt": "Once", **build(data.draw(values))}
    _refused_naming(prepare_completion, body, param, "generic")


# --- lists validation walks entry by entry ---------------------------------------------------------


def test_a_body_of_150000_content_parts_is_refused_before_it_is_parsed() -> None:
    # Before: pydantic checked each part, ~0.8 s of the event loop for one 1.95 MB body.
    body = chat_body(messages=[{"role": "user", "content": [{"type": "x"}] * 150_000}])
    error = rejected(body[:-5])  # not even valid JSON at the end: the raw count comes first
    assert "about 150000" in error.message and "at most 8192 list entries" in error.message


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        # Entries without "type" keys, so that the exact count after parsing is the one refusing.
        ({"messages": [{"role": "user", "content": [{"text": "x"}] * 6}]}, "messages"),
        ({"messages": [{"role": "assistant", "tool_calls": [{}] * 6}]}, "messages"),
        ({"tools": [{}] * 6}, "tools"),  # no "type" keys: counted after parsing
        ({"stop": ["a"] * 6}, "stop"),
        ({"logit_bias": {str(i): 1 for i in range(6)}}, "logit_bias"),
        ({"messages": [{"role": "user", "content": [{"text": "x"}] * 3}] * 2}, "messages"),
    ],
    ids=["parts", "tool-calls", "tools", "stop", "logit-bias", "parts-of-two-messages"],
)
def test_list_entries_are_capped_in_all_before_they_are_checked(fields: dict[str, Any], param: str) -> None:
    settings = Settings(max_list_entries=5)
    with pytest.raises(InvalidRequestError) as caught:
        prepare_chat(chat_body(**fields), settings, INFO)
    assert caught.value.param == param
    assert "6 entries" in caught.value.message and "at most 5 list entries" in caught.value.message


def test_list_entries_under_the_cap_and_typed_keys_spelt_with_escapes() -> None:
    settings = Settings(max_list_entries=5)
    fields = {"tools": [{"type": "function"}] * 2, "stop": ["a", "b"], "messages": [USER, USER]}
    prepare_chat(chat_body(**fields), settings, INFO)
    escaped = chat_body(tools=[{"type": "function"}] * 6).replace(b'"type"', b'"typ\\u0065"')
    with pytest.raises(InvalidRequestError) as caught:
        prepare_chat(escaped, settings, INFO)
    assert caught.value.param == "tools"


@given(entries=st.integers(min_value=1, max_value=40), limit=st.integers(min_value=1, max_value=40))
@hypothesis_settings(max_examples=200, deadline=None)
def test_the_exact_count_is_skipped_only_for_a_body_too_small_to_pass_the_limit(entries: int, limit: int) -> None:
    # The densest lists JSON has (`[0,0,...]`, `{"":0,...}`: two and five bytes an entry) are still counted exactly.
    bounds = BodyBounds(items_field="messages", items=lambda data: 0, entries=("a", "b"))
    settings = Settings(max_list_entries=limit)
    for data in ({"a": [0] * entries}, {"b": {str(i): 0 for i in range(entries)}}):
        body = orjson.dumps(data)
        if entries > limit:
            with pytest.raises(InvalidRequestError):
                bounds.check(data, settings, len(body))
        else:
            bounds.check(data, settings, len(body))


def test_completion_stop_strings_are_capped() -> None:
    with pytest.raises(InvalidRequestError) as caught:
        prepare_completion(completion_body(stop=["a"] * 6), Settings(max_list_entries=5), INFO)
    assert caught.value.param == "stop"


@pytest.mark.parametrize(
    ("path", "count"),
    [("tools", 2), ("messages[].content", 3), ("messages[].tool_calls", 0), ("stop", 0), ("logit_bias", 1)],
)
def test_count_entries(path: str, count: int) -> None:
    body = {
        "messages": [{"content": [1, 2]}, {"content": "text"}, {"content": [3]}, "not a message"],
        "tools": [{}, {}],
        "stop": "one",
        "logit_bias": {"1": 2},
    }
    assert count_entries(body, path) == count


# --- the completion cap of a key with a token limit -------------------------------------------------


@pytest.mark.parametrize(
    ("prepare", "body", "field"),
    [
        (prepare_chat, chat_body(max_tokens=None), "max_completion_tokens"),
        (prepare_completion, completion_body(), "max_tokens"),
        (prepare_responses, orjson.dumps({"model": MODEL, "input": "Hello"}), "max_output_tokens"),
    ],
    ids=["chat", "completions", "responses"],
)
def test_a_length_left_to_the_engine_is_capped_in_the_apis_own_field_and_charged(
    prepare: Callable[[bytes, Settings, ModelInfo], PreparedRequest], body: bytes, field: str
) -> None:
    prepared = prepare(body, SETTINGS, INFO)
    assert prepared.capped(None, 4096) is prepared  # a key without a token limit: left to the engine
    capped = prepared.capped(300, 4096)
    sent = orjson.loads(capped.body)
    # The whole request fits the key's limit; the body carries the one field, no null beside it.
    assert sent[field] == 300 - prepared.prompt_tokens_estimate == capped.max_tokens
    assert capped.tokens_estimate == 300
    assert [name for name in ("max_tokens", "max_completion_tokens", "max_output_tokens") if name in sent] == [field]
    # Bounded by the rest of the context when that is less.
    assert orjson.loads(prepared.capped(100_000, 4096).body)[field] == 4096 - prepared.prompt_tokens_estimate


def test_a_length_of_the_clients_is_kept_and_every_choice_is_capped() -> None:
    prepared = prepare_chat(chat_body(max_tokens=7), SETTINGS, INFO)
    assert prepared.capped(300, 4096) is prepared
    two = prepare_chat(chat_body(n=2), SETTINGS, INFO)
    assert two.capped(300, 4096).tokens_estimate <= 300
    # A prompt that fills the limit is still capped (at one token), and then refused by the limit as too large.
    assert two.capped(1, 4096).max_tokens == 1


def test_counting_tokens_is_neither_capped_nor_charged() -> None:
    body = orjson.dumps({"model": MODEL, "messages": [USER]})
    prepared = prepare_count_tokens(body, SETTINGS, INFO)
    assert not prepared.generates and prepared.tokens_estimate == 0
    assert prepared.capped(300, 4096) is prepared


def test_a_cap_of_the_gateways_is_lowered_to_what_a_budget_has_left_and_a_clients_never() -> None:
    prepared = prepare_chat(chat_body(max_tokens=None), SETTINGS, INFO)
    capped = prepared.capped(300, 4096)
    lowered = capped.recapped(100)
    assert lowered is not None
    assert lowered.tokens_estimate <= 100 and lowered.max_tokens == 100 - prepared.prompt_tokens_estimate
    sent = orjson.loads(lowered.body)
    assert sent["max_completion_tokens"] == lowered.max_tokens and "max_tokens" not in sent
    assert capped.recapped(prepared.prompt_tokens_estimate) is None  # not one token fits: the refusal stands
    assert capped.recapped(10_000) is None  # nothing to lower
    assert prepare_chat(chat_body(max_tokens=50), SETTINGS, INFO).recapped(20) is None  # the client's own length
