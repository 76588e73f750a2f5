"""Thinking budgets on the real engine (vLLM 0.32 CPU build), one `vllm serve` start: a demo model with Nemotron 3's
think markers and its template's think prompt, served with `--reasoning-parser nemotron_v3` and no
`--reasoning-config` (vLLM takes the markers from the parser), through the gateway.

The random model is kept from ending its thinking by itself (`logit_bias` -100 on `</think>` and on the end of
text), so what ends it is the budget: vLLM forces `</think>` once the budget is spent, which the completion's token
ids show (`return_token_ids`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.engine import _vllm
from tests.engine.conftest import CACHE_ROOT
from tests.engine.stacks import running_up, up_settings
from tests.procs import ServerProcess, free_port
from tools import demo_model

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

MODEL = "nemotron"
STATE_DIR = CACHE_ROOT / "engine-tests-thinking"
OPERATOR_PRESETS = """
[presets.demo-thinking]
description = "The demo model with Nemotron 3's reasoning convention."
reasoning = "enable_thinking"
reasoning-parser = "nemotron_v3"
"""


@dataclass
class Stack:
    proc: ServerProcess
    gateway: str
    engine: str
    key: str
    think_end: int
    end_of_text: int

    def chat(self, **body: Any) -> dict[str, Any]:
        """A chat answer whose thinking only the budget (or max_tokens) can end."""
        bias = {str(self.think_end): -100, str(self.end_of_text): -100}
        payload = {"model": MODEL, "max_tokens": 12, "temperature": 0, "return_token_ids": True, "logit_bias": bias}
        answer = httpx.post(
            f"{self.gateway}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], **payload, **body},
            headers={"Authorization": f"Bearer {self.key}"},
            timeout=120,
        )
        assert answer.status_code == 200, f"{answer.text}\n--- up's output ---\n{self.proc.log_text()[-6000:]}"
        return dict(answer.json())


@pytest.fixture(scope="module")
def stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    if not _vllm.vllm_installed():
        pytest.fail("vLLM is not installed in this venv: run scripts/install-engine-cpu", pytrace=False)
    tmp = tmp_path_factory.mktemp("thinking")
    model = demo_model.write_demo_model(tmp / "model", thinking=True)
    (tmp / "operator.toml").write_text(OPERATOR_PRESETS)
    engine_port, gateway_port = free_port(), free_port()
    env = up_settings(model, redis_url, engine_port=engine_port, gateway_port=gateway_port, state_dir=STATE_DIR)
    env.update(
        {
            "NEMOTRON_ENGINE__PROFILES_FILE": str(tmp / "operator.toml"),
            "NEMOTRON_RELAY__GENERATION_PROBE_TIMEOUT": "60",
            "NEMOTRON_INJECT_SYSTEM_MESSAGE": "false",
        }
    )
    ids = _token_ids(model)
    with running_up(env, "--preset", "demo-thinking", key_prefix="thinking") as (proc, key):
        yield Stack(
            proc,
            f"http://127.0.0.1:{gateway_port}",
            f"http://127.0.0.1:{engine_port}",
            key,
            ids[demo_model.THINK_END],
            ids[demo_model.EOS],
        )


def _token_ids(model: Path) -> dict[str, int]:
    vocab = json.loads((model / "tokenizer.json").read_text())
    return {t["content"]: int(t["id"]) for t in vocab["added_tokens"]}


def _reasoning(choice: dict[str, Any]) -> str | None:
    """The reasoning text (vLLM 0.32 says `reasoning`, older versions `reasoning_content`)."""
    message = choice["message"]
    return message.get("reasoning") or message.get("reasoning_content")


def test_without_a_budget_the_thinking_runs_to_max_tokens(stack: Stack) -> None:
    answer = stack.chat()
    choice = answer["choices"][0]
    assert stack.think_end not in choice["token_ids"]
    assert choice["message"]["content"] is None and _reasoning(choice)


@pytest.mark.parametrize("budget", [0, 3])
def test_the_budget_ends_the_thinking_after_that_many_tokens(stack: Stack, budget: int) -> None:
    choice = stack.chat(thinking_token_budget=budget)["choices"][0]
    assert choice["token_ids"].index(stack.think_end) == budget, choice["token_ids"]
    assert choice["message"]["content"]  # the answer after the forced </think>
    assert bool(_reasoning(choice)) == (budget > 0)


def test_a_budget_above_max_tokens_is_served_as_max_tokens(stack: Stack) -> None:
    choice = stack.chat(max_tokens=6, thinking_token_budget=2**40)["choices"][0]
    assert len(choice["token_ids"]) == 6 and stack.think_end not in choice["token_ids"]
    assert httpx.get(f"{stack.engine}/health", timeout=10).status_code == 200


def test_with_reasoning_off_the_budget_has_nothing_to_end(stack: Stack) -> None:
    answer = stack.chat(reasoning_effort="none", thinking_token_budget=3)
    assert answer["prompt_token_ids"][-1] == stack.think_end  # the template closed the thinking itself
    choice = answer["choices"][0]
    assert stack.think_end not in choice["token_ids"] and choice["message"]["content"]
