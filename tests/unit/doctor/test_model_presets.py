"""The doctor's model checks name the fix the model preset applies, and fail a reasoning model launched without its
reasoning parser; the flags checked are the preset's combined with the profile."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from gateway.doctor.check import Check, Status
from gateway.doctor.model import ModelFlags, check_model_dir
from gateway.doctor.runner import doctor_config, run_checks
from gateway.engine.presets import engine_profile
from gateway.settings import Settings
from tests.procs import free_port
from tests.unit.doctor.samples import CONFIG, TOKENIZER_CONFIG, by_name, write_model

pytestmark = pytest.mark.timeout(30)

# Nano-9B-v2's template switches on /think and /no_think and opens <think> (abridged).
THINKING_TEMPLATE = (
    "{% set reasoning = '/no_think' not in messages[0]['content'] %}"
    "{% for m in messages %}<SPECIAL_11>{{ m.role }}\n{{ m.content }}{% endfor %}"
    "{% if reasoning %}<think>\n{% else %}<think></think>{% endif %}"
)
NANO_9B = {**CONFIG, "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h"}


def model_rows(path: Path, **flags: Any) -> dict[str, Check]:
    return by_name(check_model_dir(path, ModelFlags(4096, **flags)))


def reasoning_model(root: Path, config: dict[str, Any] = NANO_9B) -> Path:
    return write_model(root, config, {**TOKENIZER_CONFIG, "chat_template": THINKING_TEMPLATE})


def test_a_reasoning_model_without_a_reasoning_parser_fails_and_names_the_presets_fix(tmp_path: Path) -> None:
    check = model_rows(reasoning_model(tmp_path / "m"))["reasoning parser"]
    assert check.status is Status.FAIL and check.blocks_start
    assert "'<think>'" in check.measured or "'/no_think'" in check.measured
    assert "--preset nemotron-nano-9b-v2 (sets --reasoning-parser nemotron_v3)" in check.fix


def test_nemotron_3_nano_is_told_apart_by_its_experts(tmp_path: Path) -> None:
    moe = {**NANO_9B, "n_routed_experts": 128}
    check = model_rows(reasoning_model(tmp_path / "m", moe))["reasoning parser"]
    assert "--preset nemotron-3-nano (sets --reasoning-parser nemotron_v3)" in check.fix


def test_a_reasoning_model_with_its_parser_passes(tmp_path: Path) -> None:
    check = model_rows(reasoning_model(tmp_path / "m"), reasoning_parser="nemotron_v3")["reasoning parser"]
    assert check.status is Status.PASS and "nemotron_v3" in check.measured


def test_a_model_without_a_reasoning_mode_needs_no_parser(tmp_path: Path) -> None:
    assert model_rows(write_model(tmp_path / "m"))["reasoning parser"].status is Status.PASS


def test_a_missing_chat_template_names_the_preset_that_ships_one(tmp_path: Path) -> None:
    no_template = {k: v for k, v in TOKENIZER_CONFIG.items() if k != "chat_template"}
    check = model_rows(write_model(tmp_path / "m", tokenizer_config=no_template))["chat template"]
    assert check.status is Status.WARN
    assert "--preset nemotron-mini-4b (sets --chat-template nemotron-mini.jinja)" in check.fix


def test_double_bos_names_the_preset_template(tmp_path: Path) -> None:
    double = {**TOKENIZER_CONFIG, "add_bos_token": True}
    check = model_rows(write_model(tmp_path / "m", tokenizer_config=double))["BOS token"]
    assert check.status is Status.WARN and "--preset nemotron-mini-4b" in check.fix


def test_the_preset_supplies_the_parser_the_doctor_looks_for(tmp_path: Path) -> None:
    """End to end through the supervisor's own argv: the same model fails under `generic`, passes under its preset."""
    model = reasoning_model(tmp_path / "m")

    def row(preset: str) -> Check:
        settings = Settings(engine={"model": str(model), "preset": preset, "profile": "cpu-dev", "port": free_port()})
        config = replace(doctor_config(settings, engine_profile(settings.engine)[0]), redis_url=None)
        # The reasoning-parser row is the gateway's own check: vLLM's verdict on the config is not asked for here.
        config = replace(config, environ={"HF_HUB_CACHE": str(tmp_path / "hf")}, max_model_len=4096, engine_python=None)
        return by_name(run_checks(config))["reasoning parser"]

    assert row("generic").status is Status.FAIL
    assert row("nemotron-nano-9b-v2").status is Status.PASS


def test_a_template_that_writes_bos_twice_is_flagged(tmp_path: Path) -> None:
    twice = {**TOKENIZER_CONFIG, "chat_template": "{{ bos_token }}" + TOKENIZER_CONFIG["chat_template"]}
    check = model_rows(write_model(tmp_path / "m", tokenizer_config=twice))["BOS token"]
    assert check.status is Status.WARN and "2 times" in check.measured
    assert "--preset nemotron-mini-4b (sets --chat-template nemotron-mini.jinja)" in check.fix


def test_a_template_that_needs_a_system_message_is_flagged(tmp_path: Path) -> None:
    needs = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('no system') }}{% endif %}{{ bos_token }}"
    check = model_rows(write_model(tmp_path / "m", tokenizer_config={**TOKENIZER_CONFIG, "chat_template": needs}))
    row = check["chat template"]
    assert row.status is Status.WARN and "messages[0]" in row.measured
    assert "NEMOTRON_INJECT_SYSTEM_MESSAGE" in row.fix and "--preset nemotron-mini-4b" in row.fix
