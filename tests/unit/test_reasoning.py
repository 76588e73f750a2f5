"""The reasoning switch and the `developer` role: for each model convention, the body the engine receives."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.api.validation import prepare_chat
from gateway.errors import InvalidRequestError
from gateway.relay.served_model import ModelInfo
from gateway.settings import DEFAULT_SYSTEM_MESSAGE, Settings

pytestmark = pytest.mark.timeout(10)

MODEL = "nemotron"
INFO = ModelInfo(MODEL, 4096)
USER = {"role": "user", "content": "What is 2 + 2?"}
CLIENT_SYSTEM = {"role": "system", "content": "Answer in French."}


def settings(preset: str, **fields: Any) -> Settings:
    return Settings(engine={"preset": preset}, **fields)


def sent(preset: str, messages: list[dict[str, Any]] | None = None, **fields: Any) -> dict[str, Any]:
    """The body the engine receives for this request under this preset (default system message on)."""
    options = {k: fields.pop(k) for k in ("inject_system_message",) if k in fields}
    body = orjson.dumps({"model": MODEL, "messages": messages or [USER], **fields})
    return dict(orjson.loads(prepare_chat(body, settings(preset, **options), INFO).body))


OFF = [{"reasoning_effort": "none"}, {"reasoning_effort": "minimal"}, {"reasoning": {"enabled": False}}]
ON = [{"reasoning_effort": "low"}, {"reasoning_effort": "high"}, {"reasoning": {"enabled": True}}]
# OpenRouter-style clients put the effort inside `reasoning`.
OFF.append({"reasoning": {"effort": "none"}})
ON.append({"reasoning": {"effort": "medium"}})


@pytest.mark.parametrize(("switch", "enabled"), [(s, False) for s in OFF] + [(s, True) for s in ON], ids=repr)
def test_enable_thinking_models_get_the_chat_template_kwarg(switch: dict[str, Any], enabled: bool) -> None:
    body = sent("nemotron-3-nano", **switch)
    assert body["chat_template_kwargs"] == {"enable_thinking": enabled}
    assert "reasoning" not in body and "reasoning_effort" not in body
    # The system prompt is the default one, untouched.
    assert body["messages"] == [{"role": "system", "content": DEFAULT_SYSTEM_MESSAGE}, USER]


def test_enable_thinking_keeps_the_clients_other_template_kwargs() -> None:
    body = sent("nemotron-3-nano", reasoning={"enabled": False}, chat_template_kwargs={"truncate_history": True})
    assert body["chat_template_kwargs"] == {"truncate_history": True, "enable_thinking": False}


@pytest.mark.parametrize(("switch", "line"), [(OFF[0], "/no_think"), (ON[2], "/think")], ids=repr)
def test_think_line_models_get_the_line_after_the_clients_system_message(switch: dict[str, Any], line: str) -> None:
    body = sent("nemotron-nano-9b-v2", [CLIENT_SYSTEM, USER], **switch)
    assert body["messages"] == [{"role": "system", "content": f"Answer in French.\n{line}"}, USER]
    # vLLM's nemotron_v3 reasoning parser reads it, so a short answer without </think> stays content.
    assert body["chat_template_kwargs"] == {"enable_thinking": line == "/think"}
    assert "reasoning" not in body and "reasoning_effort" not in body


def test_the_default_system_message_keeps_the_switch() -> None:
    """A model whose switch lives in the system prompt must not lose it to the default message: merged, one message."""
    body = sent("nemotron-nano-9b-v2", reasoning={"enabled": False})
    assert body["messages"] == [{"role": "system", "content": f"{DEFAULT_SYSTEM_MESSAGE}\n/no_think"}, USER]


def test_without_a_default_message_the_switch_is_a_system_message_of_its_own() -> None:
    body = sent("nemotron-nano-9b-v2", reasoning={"enabled": True}, inject_system_message=False)
    assert body["messages"] == [{"role": "system", "content": "/think"}, USER]


def test_the_switch_replaces_a_contrary_line_the_client_wrote() -> None:
    system = {"role": "system", "content": "/think\nAnswer in French."}
    body = sent("nemotron-nano-9b-v2", [system, USER], reasoning_effort="none")
    assert body["messages"][0]["content"] == "Answer in French.\n/no_think"


def test_detailed_thinking_models_get_the_line_first_in_the_system_message() -> None:
    off = sent("llama-nemotron-nano-8b", [CLIENT_SYSTEM, USER], reasoning_effort="minimal")
    assert off["messages"] == [{"role": "system", "content": "detailed thinking off\nAnswer in French."}, USER]
    on = sent("llama-nemotron-nano-8b", reasoning={"enabled": True})
    assert on["messages"][0] == {"role": "system", "content": f"detailed thinking on\n{DEFAULT_SYSTEM_MESSAGE}"}
    assert "chat_template_kwargs" not in on and "reasoning" not in on


def test_a_system_message_in_content_parts_gets_a_part() -> None:
    system = {"role": "system", "content": [{"type": "text", "text": "Answer in French."}]}
    body = sent("nemotron-nano-9b-v2", [system, USER], reasoning={"enabled": False})
    assert body["messages"][0]["content"] == [
        {"type": "text", "text": "Answer in French."},
        {"type": "text", "text": "/no_think"},
    ]


@pytest.mark.parametrize("preset", ["nemotron-3-nano", "nemotron-nano-9b-v2", "llama-nemotron-nano-8b"])
def test_without_a_switch_the_request_is_left_to_the_models_default(preset: str) -> None:
    body = sent(preset, [CLIENT_SYSTEM, USER])
    assert body["messages"] == [CLIENT_SYSTEM, USER]
    assert "chat_template_kwargs" not in body


def test_a_model_without_reasoning_keeps_reasoning_effort_for_vllm() -> None:
    body = sent("generic", reasoning_effort="high", reasoning={"enabled": True})
    assert body["reasoning_effort"] == "high" and "reasoning" not in body
    assert body["messages"] == [{"role": "system", "content": DEFAULT_SYSTEM_MESSAGE}, USER]


def test_thinking_budget_passes_through() -> None:
    body = sent("nemotron-3-nano", reasoning={"enabled": True}, thinking_token_budget=512)
    assert body["thinking_token_budget"] == 512


def test_a_contradictory_switch_is_a_400() -> None:
    with pytest.raises(InvalidRequestError) as caught:
        sent("nemotron-3-nano", reasoning={"enabled": True}, reasoning_effort="none")
    assert caught.value.param == "reasoning" and "send one of them" in caught.value.message


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("reasoning_effort", "maximal"),
        ("reasoning_effort", 1),
        ("reasoning", {"enabled": "yes"}),
        ("reasoning", True),
        ("reasoning", {}),
        ("reasoning", {"effort": "huge"}),
    ],
)
def test_a_malformed_switch_is_a_400(field: str, value: Any) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        sent("nemotron-3-nano", **{field: value})
    assert caught.value.param is not None and caught.value.param.startswith(field)


def test_developer_role_is_sent_as_system() -> None:
    developer = {"role": "developer", "content": "Answer in French."}
    body = sent("generic", [developer, USER])
    # It counts as the client's system message: no default message is added in front of it.
    assert body["messages"] == [CLIENT_SYSTEM, USER]


def test_developer_message_keeps_the_reasoning_switch() -> None:
    developer = {"role": "developer", "content": "Answer in French."}
    body = sent("nemotron-nano-9b-v2", [developer, USER], reasoning={"enabled": False})
    assert body["messages"][0] == {"role": "system", "content": "Answer in French.\n/no_think"}


def test_an_operator_preset_declares_its_own_switch(tmp_path: Path) -> None:
    extra = tmp_path / "profiles.toml"
    extra.write_text('[presets.my-model]\ndescription = "mine"\nreasoning = "detailed_thinking"\n')
    body = orjson.dumps({"model": MODEL, "messages": [USER], "reasoning_effort": "none"})
    prepared = prepare_chat(body, Settings(engine={"preset": "my-model", "profiles_file": extra}), INFO)
    assert orjson.loads(prepared.body)["messages"][0]["content"].startswith("detailed thinking off\n")
