"""The GPU `presets` step's own logic, checked here so GPU time is spent measuring: the Nemotron 3 template ending
it adds shows the reasoning switch in the rendered prompt, and a check against a missing stack is recorded, not
raised."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import pytest

from tests.gpu import presets

pytestmark = pytest.mark.timeout(30)

DEMO_LIKE = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}\n{% endfor %}"


def render(template: str, **kwargs: object) -> str:
    messages = [{"role": "user", "content": "Hi"}]
    return jinja2.Template(template).render(messages=messages, bos_token="<s>", add_generation_prompt=True, **kwargs)


def test_the_thinking_ending_shows_the_switch(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": DEMO_LIKE, "bos_token": "<s>"}))
    presets.add_thinking_template(str(tmp_path))
    template = json.loads((tmp_path / "tokenizer_config.json").read_text())["chat_template"]
    off, on = presets.MARKERS["nemotron-3-nano"]
    assert render(template, enable_thinking=False).endswith(off)
    assert render(template, enable_thinking=True).endswith(on) and off not in render(template, enable_thinking=True)
    assert render(template).endswith(on)  # the model's default: thinking on


def test_a_check_against_no_stack_is_a_recorded_error(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["check", "--preset", "nemotron-nano-9b-v2", "--api-key", "k", "--ready-s", "1"]
    argv += ["--gateway", "http://127.0.0.1:9", "--engine", "http://127.0.0.1:9"]
    assert presets.main(argv) == 0
    line = json.loads(capsys.readouterr().out)
    assert line["preset"] == "nemotron-nano-9b-v2" and line["ready_s"] == 1.0
    assert {"stream", "reasoning", "tools"} <= set(line) and "error" in line["stream"]
