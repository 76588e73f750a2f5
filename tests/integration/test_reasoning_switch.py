"""The reasoning switch through the real gateway: for each model convention, the body the engine
receives, as the fake engine recorded it, is exactly what that model expects; the OpenAI SDK's own
`reasoning_effort` and `developer` role work unchanged."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from gateway.settings import DEFAULT_SYSTEM_MESSAGE
from tests.procs import FakeEngineControl, run_gateway

MODEL = "nemotron-test"
USER = {"role": "user", "content": "What is 2 + 2?"}
DEVELOPER = {"role": "developer", "content": "Answer in French."}


@pytest.fixture(scope="module", params=["nemotron-3-nano", "nemotron-nano-9b-v2", "llama-nemotron-nano-8b"])
def preset_gateway(
    request: pytest.FixtureRequest, fake_engine: FakeEngineControl, redis_url: str
) -> Iterator[tuple[str, str]]:
    env = {"NEMOTRON_AUTH__ENABLED": "false", "NEMOTRON_ENGINE__PRESET": request.param}
    with run_gateway(fake_engine.base_url, redis_url, env=env) as proc:
        yield request.param, f"http://127.0.0.1:{proc.port}"


def received(engine: FakeEngineControl, base_url: str, **request: Any) -> dict[str, Any]:
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=20) as sdk:
        sdk.chat.completions.create(model=MODEL, **request)
    return dict(engine.requests()[-1]["body"])


EXPECTED_OFF: dict[str, dict[str, Any]] = {
    "nemotron-3-nano": {
        "messages": [{"role": "system", "content": "Answer in French."}, USER],
        "chat_template_kwargs": {"enable_thinking": False},
    },
    "nemotron-nano-9b-v2": {
        "messages": [{"role": "system", "content": "Answer in French.\n/no_think"}, USER],
        "chat_template_kwargs": {"enable_thinking": False},
    },
    "llama-nemotron-nano-8b": {
        "messages": [{"role": "system", "content": "detailed thinking off\nAnswer in French."}, USER],
    },
}


def test_switch_off_reaches_the_engine_in_the_models_convention(
    preset_gateway: tuple[str, str], engine: FakeEngineControl
) -> None:
    preset, base_url = preset_gateway
    body = received(engine, base_url, messages=[DEVELOPER, USER], reasoning_effort="minimal")
    for field, value in EXPECTED_OFF[preset].items():
        assert body[field] == value, field
    assert "reasoning_effort" not in body and "reasoning" not in body
    assert ("chat_template_kwargs" in body) == ("chat_template_kwargs" in EXPECTED_OFF[preset])


def test_switch_on_merges_with_the_default_system_message(
    preset_gateway: tuple[str, str], engine: FakeEngineControl
) -> None:
    preset, base_url = preset_gateway
    body = received(engine, base_url, messages=[USER], extra_body={"reasoning": {"enabled": True}})
    system = body["messages"][0]
    assert system["role"] == "system" and DEFAULT_SYSTEM_MESSAGE in system["content"]
    assert len([m for m in body["messages"] if m["role"] == "system"]) == 1
    if preset == "nemotron-3-nano":
        assert system["content"] == DEFAULT_SYSTEM_MESSAGE and body["chat_template_kwargs"] == {"enable_thinking": True}
    elif preset == "nemotron-nano-9b-v2":
        assert system["content"] == f"{DEFAULT_SYSTEM_MESSAGE}\n/think"
    else:
        assert system["content"] == f"detailed thinking on\n{DEFAULT_SYSTEM_MESSAGE}"


def test_no_switch_leaves_the_models_default(preset_gateway: tuple[str, str], engine: FakeEngineControl) -> None:
    _, base_url = preset_gateway
    body = received(engine, base_url, messages=[DEVELOPER, USER])
    assert body["messages"] == [{"role": "system", "content": "Answer in French."}, USER]
    assert "chat_template_kwargs" not in body
