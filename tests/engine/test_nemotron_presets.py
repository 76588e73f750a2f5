"""Serving Nemotron right on the real engine, one `vllm serve` start for the module: a demo model with
seeded chat-format defects (its template writes BOS twice and fails without a system message) is flagged by the
doctor, fixed by a model preset (engine_patches' shipped template), and answers through the gateway with one BOS;
the reasoning switch reaches the prompt vLLM renders; the engine_patches plugin is loaded by vLLM and its
`nemotron_json` parser turns a `<TOOLCALL>` the model emits into `tool_calls`, streamed and not.

The rendered prompt is read back honestly: vLLM's `return_token_ids` returns the prompt's token ids, and the
engine's own /detokenize turns them back into text. The random model is made to emit the tool-call token with
`logit_bias` (it is one added token whose text is a whole call).
"""

from __future__ import annotations

import configparser
import importlib.metadata
import json
import os
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.doctor.check import Status
from gateway.doctor.model import ModelFlags, check_model_dir
from tests.engine import _vllm
from tests.engine.conftest import CACHE_ROOT
from tests.engine.stacks import running_up, up_settings
from tests.procs import REPO_ROOT, ServerProcess, free_port
from tools import demo_model

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

MODEL = "nemotron"
STATE_DIR = CACHE_ROOT / "engine-tests-presets"
PLUGIN_GROUP = "vllm.general_plugins"
# An operator preset on top of the shipped Nemotron-Mini one: its template, plus a reasoning switch in the system
# message and the plugin's tool parser, so one engine start exercises all three.
OPERATOR_PRESETS = """
[presets.demo-nemotron]
extends = "nemotron-mini-4b"
reasoning = "think_line"
enable-auto-tool-choice = true
tool-call-parser = "nemotron_json"
"""
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@dataclass
class Stack:
    proc: ServerProcess
    gateway: str
    engine: str
    key: str
    model_dir: Path

    def chat(self, **body: Any) -> dict[str, Any]:
        payload = {"model": MODEL, "max_tokens": 4, "temperature": 0, **body}
        answer = httpx.post(
            f"{self.gateway}/v1/chat/completions",
            json=payload,
            headers={"Authorization": f"Bearer {self.key}"},
            timeout=120,
        )
        assert answer.status_code == 200, f"{answer.text}\n--- up's output ---\n{self.proc.log_text()[-6000:]}"
        return dict(answer.json())

    def rendered_prompt(self, **body: Any) -> tuple[list[int], str]:
        """The prompt token ids vLLM generated from, and their text (the engine's own /detokenize)."""
        ids = self.chat(return_token_ids=True, **body)["prompt_token_ids"]
        text = httpx.post(f"{self.engine}/detokenize", json={"model": MODEL, "tokens": ids}, timeout=30).json()
        return ids, str(text["prompt"])

    def sdk(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.gateway}/v1", api_key=self.key, max_retries=0, timeout=120)


def _token_id(model_dir: Path, text: str) -> int:
    vocab = json.loads((model_dir / "tokenizer.json").read_text())
    added = {t["content"]: t["id"] for t in vocab["added_tokens"]}
    return int(added[text]) if text in added else int(vocab["model"]["vocab"][text])


def _plugin_path(tmp: Path) -> str | None:
    """A PYTHONPATH entry declaring the plugin when this venv was installed before pyproject declared it.

    The entry point comes from pyproject.toml itself, so what vLLM loads is what a fresh install declares; an
    up-to-date install needs nothing (None).
    """
    if any(ep.value.startswith("engine_patches.") for ep in importlib.metadata.entry_points(group=PLUGIN_GROUP)):
        return None
    declared = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["entry-points"][PLUGIN_GROUP]
    dist = tmp / "nemotron_gateway_plugin-0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: nemotron-gateway-plugin\nVersion: 0\n")
    entry_points = configparser.ConfigParser()
    entry_points[PLUGIN_GROUP] = dict(declared)
    with (dist / "entry_points.txt").open("w") as handle:
        entry_points.write(handle)
    return str(tmp)


@pytest.fixture(scope="module")
def defective_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not _vllm.vllm_installed():
        pytest.fail("vLLM is not installed in this venv: run scripts/install-engine-cpu", pytrace=False)
    root = tmp_path_factory.mktemp("defective")
    return demo_model.write_demo_model(root / "model", defects=frozenset({"double-bos", "needs-system"}))


@pytest.fixture(scope="module")
def stack(defective_model: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    engine_port, gateway_port = free_port(), free_port()
    tmp = tmp_path_factory.mktemp("presets")
    (tmp / "operator.toml").write_text(OPERATOR_PRESETS)
    env = up_settings(
        defective_model, redis_url, engine_port=engine_port, gateway_port=gateway_port, state_dir=STATE_DIR
    )
    env.update(
        {
            "NEMOTRON_ENGINE__PROFILES_FILE": str(tmp / "operator.toml"),
            # The CPU engine's first generations on a busy 2-core machine may outlast the default 10 s probe.
            "NEMOTRON_RELAY__GENERATION_PROBE_TIMEOUT": "60",
            # Requests reach the engine without a system message unless they carry one: the template must cope.
            "NEMOTRON_INJECT_SYSTEM_MESSAGE": "false",
        }
    )
    if (plugin_path := _plugin_path(tmp / "plugin")) is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [plugin_path, os.environ.get("PYTHONPATH")]))
    with running_up(env, "--preset", "demo-nemotron", key_prefix="presets") as (proc, key):
        yield Stack(proc, f"http://127.0.0.1:{gateway_port}", f"http://127.0.0.1:{engine_port}", key, defective_model)


def test_the_doctor_finds_the_seeded_defects_and_names_the_preset(defective_model: Path, tmp_path: Path) -> None:
    rows = {c.name: c for c in check_model_dir(defective_model, ModelFlags(2048))}
    assert rows["BOS token"].status is Status.WARN and "2 times" in rows["BOS token"].measured
    assert rows["chat template"].status is Status.WARN and "messages[0]" in rows["chat template"].measured
    for row in ("BOS token", "chat template"):
        assert "--preset nemotron-mini-4b (sets --chat-template nemotron-mini.jinja)" in rows[row].fix
    missing = demo_model.write_demo_model(tmp_path / "bare", defects=frozenset({"no-template"}))
    bare = {c.name: c for c in check_model_dir(missing, ModelFlags(2048))}["chat template"]
    assert bare.status is Status.WARN and "--preset nemotron-mini-4b" in bare.fix
    template = Path(str(REPO_ROOT / "engine_patches" / "templates" / "nemotron-mini.jinja"))
    fixed = {c.name: c for c in check_model_dir(defective_model, ModelFlags(2048, chat_template=template))}
    assert fixed["chat template"].status is Status.PASS
    assert "2 times" not in fixed["BOS token"].measured


def test_vllm_loads_the_plugin_and_says_what_it_applied(stack: Stack) -> None:
    assert "nemotron engine_patches loaded: tool parser nemotron_json" in stack.proc.log_text()


def test_the_preset_serves_one_bos_without_a_system_message(stack: Stack) -> None:
    bos = _token_id(stack.model_dir, demo_model.BOS)
    ids, text = stack.rendered_prompt(messages=[{"role": "user", "content": "Hello!"}])
    assert ids[0] == bos and ids.count(bos) == 1, ids[:8]
    assert "<extra_id_1>User\nHello!" in text


@pytest.mark.parametrize(
    ("switch", "line", "other"),
    [
        ({"reasoning_effort": "none"}, "/no_think", "/think\n"),
        ({"reasoning": {"enabled": True}}, "/think", "/no_think"),
    ],
)
def test_the_reasoning_switch_reaches_the_rendered_prompt(
    stack: Stack, switch: dict[str, Any], line: str, other: str
) -> None:
    system = {"role": "developer", "content": "Answer in French."}
    _, text = stack.rendered_prompt(messages=[system, {"role": "user", "content": "Hi"}], **switch)
    assert f"<extra_id_0>System\nAnswer in French.\n{line}\n" in text
    assert other not in text


def test_without_a_switch_the_prompt_has_none(stack: Stack) -> None:
    _, text = stack.rendered_prompt(messages=[{"role": "user", "content": "Hi"}])
    assert "think" not in text


def _tool_request(stack: Stack) -> dict[str, Any]:
    tool_token = _token_id(stack.model_dir, demo_model.TOOL_CALL_TEXT)
    return {
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [WEATHER_TOOL],
        "tool_choice": "auto",
        "max_tokens": 1,
        "logit_bias": {str(tool_token): 100},
    }


def test_a_toolcall_comes_back_as_tool_calls(stack: Stack) -> None:
    choice = stack.chat(**_tool_request(stack))["choices"][0]
    calls = choice["message"]["tool_calls"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert choice["finish_reason"] in ("tool_calls", "length")
    assert not choice["message"].get("content")


def test_a_streamed_toolcall_comes_back_as_tool_call_deltas(stack: Stack) -> None:
    request = _tool_request(stack)
    with stack.sdk() as sdk:
        stream = sdk.chat.completions.create(
            model=MODEL,
            messages=request["messages"],
            tools=request["tools"],
            tool_choice="auto",
            max_tokens=1,
            stream=True,
            extra_body={"logit_bias": request["logit_bias"]},
        )
        names, arguments, content = [], "", ""
        for chunk in stream:
            for choice in chunk.choices:
                content += choice.delta.content or ""
                for call in choice.delta.tool_calls or []:
                    if call.function and call.function.name:
                        names.append(call.function.name)
                    arguments += (call.function.arguments or "") if call.function else ""
    assert names == ["get_weather"] and json.loads(arguments) == {"city": "Paris"}
    assert "<TOOLCALL>" not in content
