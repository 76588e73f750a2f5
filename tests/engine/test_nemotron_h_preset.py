"""The `nemotron-nano-9b-v2` preset, unchanged, on a real hybrid-Mamba engine: the CPU build of vLLM serves
a tiny NemotronHForCausalLM (Nano-9B-v2's layer layout, random weights through `--load-format dummy`) with the
preset's flags (`--mamba-ssm-cache-dtype float32`, `--reasoning-parser nemotron_v3`, `--tool-call-parser
nemotron_json`); the reasoning switch reaches the rendered prompt, a `<TOOLCALL>` comes back as `tool_calls`, and
a streamed answer with the reasoning parser on ends cleanly. One engine start for the module.

float32: the tiny model's numbers stay sane, and the CPU build's bf16 attention kernel (AMX) dies with SIGILL on
some hosts. Nemotron 3 Nano's MoE (a non-gated relu2 expert) is not served by the CPU build ("is_act_and_mul=False
is supported only for CUDA, XPU and ROCm"): that preset is checked on the GPU (loadtest/gpu/run presets).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.engine import _vllm
from tests.engine.conftest import CACHE_ROOT
from tests.engine.stacks import running_up, up_settings
from tests.engine.test_nemotron_presets import WEATHER_TOOL, Stack, _plugin_path, _token_id
from tests.procs import free_port
from tools import demo_model

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

MODEL = "nemotron"
STATE_DIR = CACHE_ROOT / "engine-tests-nemotron-h"


@pytest.fixture(scope="module")
def stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    if not _vllm.vllm_installed():
        pytest.fail("vLLM is not installed in this venv: run scripts/install-engine-cpu", pytrace=False)
    tmp = tmp_path_factory.mktemp("nemotron-h")
    model = demo_model.write_tiny_nemotron_h(tmp / "model")
    engine_port, gateway_port = free_port(), free_port()
    env = up_settings(model, redis_url, engine_port=engine_port, gateway_port=gateway_port, state_dir=STATE_DIR)
    env.update(
        {
            "NEMOTRON_ENGINE__EXTRA_ARGS": '["--load-format", "dummy", "--dtype", "float32"]',
            "NEMOTRON_RELAY__GENERATION_PROBE_TIMEOUT": "60",
            "NEMOTRON_INJECT_SYSTEM_MESSAGE": "false",
        }
    )
    if (plugin_path := _plugin_path(tmp / "plugin")) is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [plugin_path, os.environ.get("PYTHONPATH")]))
    with running_up(env, "--preset", "nemotron-nano-9b-v2", key_prefix="nemotron-h") as (proc, key):
        yield Stack(proc, f"http://127.0.0.1:{gateway_port}", f"http://127.0.0.1:{engine_port}", key, Path(model))


def test_the_hybrid_mamba_engine_runs_the_presets_flags(stack: Stack) -> None:
    log = stack.proc.log_text()
    assert "NemotronHForCausalLM" in log
    for flag in (
        "--mamba-ssm-cache-dtype float32",
        "--reasoning-parser nemotron_v3",
        "--tool-call-parser nemotron_json",
    ):
        assert flag in log, flag
    assert "nemotron engine_patches loaded: tool parser nemotron_json" in log


@pytest.mark.parametrize(("switch", "line"), [({"reasoning_effort": "none"}, "/no_think"), ({}, None)])
def test_the_think_line_reaches_the_rendered_prompt(stack: Stack, switch: dict[str, Any], line: str | None) -> None:
    system = {"role": "system", "content": "Be brief."}
    _, text = stack.rendered_prompt(messages=[system, {"role": "user", "content": "Hi"}], **switch)
    if line is None:
        assert "think" not in text
    else:
        assert f"<extra_id_0>System\nBe brief.\n{line}\n" in text


def test_a_toolcall_from_the_hybrid_model_is_tool_calls(stack: Stack) -> None:
    tool_token = _token_id(stack.model_dir, demo_model.TOOL_CALL_TEXT)
    choice = stack.chat(
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER_TOOL],
        tool_choice="auto",
        max_tokens=1,
        logit_bias={str(tool_token): 100},
        # Random weights never close </think>: with reasoning on, the parser would keep the call as reasoning.
        reasoning={"enabled": False},
    )["choices"][0]
    calls = choice["message"]["tool_calls"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]


def test_a_streamed_answer_with_the_reasoning_parser_ends_cleanly(stack: Stack) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "stream": True}
    lines: list[str] = []
    with httpx.stream(
        "POST",
        f"{stack.gateway}/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {stack.key}"},
        timeout=120,
    ) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in lines[:-1] if json.loads(line[6:])["choices"]]
    # Reasoning on by default, random weights: the text goes to the reasoning field, never `</think>` into content.
    assert "</think>" not in "".join(d.get("content") or "" for d in deltas)
