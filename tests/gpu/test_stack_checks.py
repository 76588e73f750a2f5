"""The GPU machine's functional checks under pytest, against a stack that is already running (marker `gpu`).

Skipped unless NEMOTRON_TEST_GATEWAY_URL names the gateway (with NEMOTRON_TEST_GATEWAY_KEY, a key it accepts);
NEMOTRON_TEST_ENGINE_URL (default http://127.0.0.1:8001) and NEMOTRON_TEST_PRESET (default nemotron-3-nano) say
where the engine answers /detokenize and which preset it serves. E.g., beside `nemotron-gateway up --preset X`:

    NEMOTRON_TEST_GATEWAY_URL=http://127.0.0.1:8000 NEMOTRON_TEST_GATEWAY_KEY=sk-... \
        .venv/bin/pytest -m gpu tests/gpu -n 0
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import pytest

from tests.gpu import apis, presets

GATEWAY_URL = os.environ.get("NEMOTRON_TEST_GATEWAY_URL")
GATEWAY_KEY = os.environ.get("NEMOTRON_TEST_GATEWAY_KEY", "")
ENGINE_URL = os.environ.get("NEMOTRON_TEST_ENGINE_URL", "http://127.0.0.1:8001")
PRESET = os.environ.get("NEMOTRON_TEST_PRESET", "nemotron-3-nano")
MODEL = os.environ.get("NEMOTRON_TEST_MODEL", "nemotron")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(600),
    pytest.mark.skipif(GATEWAY_URL is None, reason="no running stack: set NEMOTRON_TEST_GATEWAY_URL"),
]


@pytest.mark.parametrize(("check", "stream"), [(apis.responses, True), (apis.responses, False)], ids=["stream", "once"])
def test_the_responses_api_answers_through_the_gateway(check: Any, stream: bool) -> None:
    assert GATEWAY_URL is not None
    result = check(GATEWAY_URL, GATEWAY_KEY, MODEL, 32, stream=stream)
    assert result["status"] == 200 and result["error"] is None and result["usage"], result


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "once"])
def test_the_messages_api_answers_through_the_gateway(stream: bool) -> None:
    assert GATEWAY_URL is not None
    result = apis.messages(GATEWAY_URL, GATEWAY_KEY, MODEL, 32, stream=stream)
    assert result["status"] == 200 and result["error"] is None and result["usage"], result


def test_the_preset_streams_switches_reasoning_and_calls_tools() -> None:
    args = argparse.Namespace(
        preset=PRESET, gateway=GATEWAY_URL, engine=ENGINE_URL, api_key=GATEWAY_KEY, model=MODEL, ready_s=0.0
    )
    result = presets.check(args)
    failed = {name: part for name, part in result.items() if isinstance(part, dict) and "error" in part}
    assert failed == {}, failed
    assert result["stream"]["done"] and result["stream"]["chunks"] > 0, result["stream"]
    assert result["reasoning"] == {"off_in_prompt": True, "on_in_prompt": True}, result["reasoning"]
    if "tools" in result:  # the nemotron_json parser's preset
        assert [name for name, _ in result["tools"]["tool_calls"]] == ["get_weather"], result["tools"]
