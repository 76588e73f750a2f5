"""The doctor checks the engine's effective flags: the argv the supervisor builds (profile, then extra args),
so a flag that changes what the model directory must hold changes the verdict."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from gateway.doctor.check import Check, Status
from gateway.doctor.flags import EngineFlags, engine_flags, human_int, parse_flags
from gateway.doctor.runner import doctor_config, run_checks
from gateway.engine.launch import prepare
from gateway.engine.presets import engine_profile
from gateway.engine.profiles import load_profiles, select_profile
from gateway.settings import Settings
from tests.procs import free_port
from tests.unit.doctor.samples import CONFIG, TEMPLATE_NO_BOS, TOKENIZER_CONFIG, by_name, write_model

pytestmark = pytest.mark.timeout(30)


def engine_settings(model: str | Path, profile: str, *extra_args: str, **engine: Any) -> Settings:
    return Settings(
        engine={"model": str(model), "profile": profile, "extra_args": list(extra_args), "port": free_port(), **engine}
    )


def rows_for(tmp_path: Path, model: str | Path, *extra_args: str, profile: str = "balanced") -> dict[str, Check]:
    """The doctor's rows for the engine the supervisor would start with this profile and these extra args."""
    settings = engine_settings(model, profile, *extra_args)
    config = doctor_config(settings, engine_profile(settings.engine)[0])
    # Redis is not what these tests are about; the hub cache is a private one. What each flag changes is read by the
    # gateway's own rules here (a host without vLLM); test_engine_verdict.py holds vLLM's verdict to the same flags.
    private = {"HF_HUB_CACHE": str(tmp_path / "hf")}
    return by_name(run_checks(replace(config, redis_url=None, environ=private, engine_python=None)))


def without_weights(root: Path) -> Path:
    model = write_model(root)
    (model / "model.safetensors").unlink()
    return model


# --- reading an argv ----------------------------------------------------------------------------------------


def test_parse_flags_follows_vllm_argparse() -> None:
    argv = [
        "python", "-m", "vllm.entrypoints.openai.api_server",
        "--model", "/m", "--max-model-len", "4096", "--enforce-eager",
        "--load-format=DUMMY", "--max-model-len", "2k", "--quantization", "awq",
        "--hf-overrides", '{"rope_theta": 10000, "text_config": {"a": 1}}', "--hf-overrides.text_config.b", "2",
        "--tokenizer", "/t", "--chat-template", "{{ x }}\n", "--gpu-memory-utilization", "0.85",
    ]  # fmt: skip
    flags = parse_flags(argv)
    assert flags == EngineFlags(
        model="/m",
        tokenizer="/t",
        chat_template="{{ x }}\n",
        max_model_len=2000,  # the last one wins, as in argparse
        gpu_memory_utilization=0.85,
        load_format="dummy",
        quantization="awq",
        hf_overrides={"rope_theta": 10000, "text_config": {"a": 1, "b": 2}},
    )
    assert parse_flags(["--max-model-len", "auto"]).max_model_len is None
    assert parse_flags(["--max-model-len", "-1"]).max_model_len is None
    assert parse_flags(["--hf-overrides", "[1]"]).hf_overrides_error == "--hf-overrides '[1]' is not a JSON object"


@pytest.mark.parametrize(("text", "value"), [("4096", 4096), ("4k", 4000), ("4K", 4096), ("25.6k", 25600), ("x", None)])
def test_human_int_reads_vllm_lengths(text: str, value: int | None) -> None:
    assert human_int(text) == value


def test_extra_args_come_after_the_profile() -> None:
    profile = select_profile(load_profiles(), "balanced")
    flags = engine_flags(engine_settings("/m", "balanced", "--max-model-len", "8192").engine, profile)
    assert (flags.model, flags.max_model_len, flags.gpu_memory_utilization) == ("/m", 8192, 0.90)
    assert engine_flags(Settings(engine={"model": None}).engine, profile).model is None


def test_the_doctor_reads_the_argv_the_supervisor_launches(tmp_path: Path) -> None:
    # A configured launcher: prepare() builds the supervisor's real argv without probing for vLLM.
    extra = ("--load-format", "dummy", "--tokenizer", str(tmp_path), "--hf-overrides", '{"rope_theta": 1e4}')
    settings = engine_settings("/m", "awq", *extra, launcher=["python", "-m", "engine"])
    profile, argv, _ = prepare(settings, check_flags=False)
    assert parse_flags(argv) == engine_flags(settings.engine, profile)
    config = doctor_config(settings, profile)
    assert (config.load_format, config.tokenizer, config.quantization) == ("dummy", str(tmp_path), "awq")
    assert config.hf_overrides == {"rope_theta": 1e4}
    assert config.engine_python is None  # a custom launcher is not the installed vLLM's server: nothing to ask it
    own = doctor_config(
        settings.model_copy(update={"engine": settings.engine.model_copy(update={"launcher": None})}), profile
    )
    assert own.engine_python is not None and own.engine_args == tuple(argv[3:])  # the argv, without the launcher


# --- what each flag changes in the model directory ----------------------------------------------------------


def test_load_format_dummy_needs_no_weights(tmp_path: Path) -> None:
    model = without_weights(tmp_path / "m")
    assert rows_for(tmp_path, model)["model directory"].blocks_start  # without the flag: finish the download
    rows = rows_for(tmp_path, model, "--load-format", "dummy")
    assert rows["model directory"].status is Status.PASS
    assert "--load-format dummy" in rows["model directory"].measured
    assert not [c for c in rows.values() if c.blocks_start and c.name not in ("NVIDIA GPU", "engine port")]


def test_load_format_safetensors_needs_safetensors(tmp_path: Path) -> None:
    model = without_weights(tmp_path / "m")
    (model / "pytorch_model.bin").write_bytes(bytes(64))
    assert rows_for(tmp_path, model)["model directory"].status is Status.PASS
    row = rows_for(tmp_path, model, "--load-format", "safetensors")["model directory"]
    assert row.blocks_start and "*.safetensors" in row.measured


def test_tokenizer_given_in_extra_args(tmp_path: Path) -> None:
    model = write_model(tmp_path / "awq", tokenizer=False)
    base = write_model(tmp_path / "base")
    assert rows_for(tmp_path, model)["tokenizer"].blocks_start
    assert rows_for(tmp_path, model, "--tokenizer", str(base))["tokenizer"].status is Status.PASS


def test_chat_template_given_in_extra_args_as_a_file_or_inline(tmp_path: Path) -> None:
    no_template = {k: v for k, v in TOKENIZER_CONFIG.items() if k != "chat_template"}
    model = write_model(tmp_path / "m", tokenizer_config=no_template)
    assert rows_for(tmp_path, model)["chat template"].status is Status.WARN
    template = tmp_path / "nemotron.jinja"
    template.write_text(TEMPLATE_NO_BOS)
    from_file = rows_for(tmp_path, model, "--chat-template", str(template))["chat template"]
    assert from_file.status is Status.PASS and str(template) in from_file.measured
    inline = rows_for(tmp_path, model, "--chat-template", TEMPLATE_NO_BOS)["chat template"]
    assert inline.status is Status.PASS and "inline" in inline.measured
    missing = rows_for(tmp_path, model, "--chat-template", str(tmp_path / "none.jinja"))["chat template"]
    assert missing.status is Status.FAIL


def test_max_model_len_in_extra_args_overrides_the_profile(tmp_path: Path) -> None:
    model = write_model(tmp_path / "m")  # allows 4096, the profile's length
    assert rows_for(tmp_path, model)["context length"].status is Status.PASS
    assert rows_for(tmp_path, model, "--max-model-len", "8192")["context length"].blocks_start
    short = write_model(tmp_path / "short", {**CONFIG, "max_position_embeddings": 2048})
    assert rows_for(tmp_path, short)["context length"].blocks_start  # the profile's 4096 is too long
    fitted = rows_for(tmp_path, short, "--max-model-len", "2k")["context length"]
    assert fitted.status is Status.PASS and "--max-model-len 2000" in fitted.measured


def test_quantization_needs_a_checkpoint_of_that_scheme(tmp_path: Path) -> None:
    plain = write_model(tmp_path / "plain")
    row = rows_for(tmp_path, plain, profile="awq")["model config"]
    assert row.blocks_start and "not quantized" in row.measured and "awq checkpoint" in row.fix
    awq_config = {**CONFIG, "quantization_config": {"quant_method": "awq", "bits": 4}}
    awq = write_model(tmp_path / "awq", awq_config)
    assert rows_for(tmp_path, awq, profile="awq")["model config"].status is Status.PASS
    assert rows_for(tmp_path, awq, "--quantization", "awq_marlin")["model config"].status is Status.PASS
    mismatch = rows_for(tmp_path, awq, "--quantization", "gptq")["model config"]
    assert mismatch.blocks_start and "awq checkpoint" in mismatch.measured
    separate = write_model(tmp_path / "separate")
    (separate / "quantize_config.json").write_text(json.dumps({"bits": 4, "quant_method": "awq"}))
    assert rows_for(tmp_path, separate, profile="awq")["model config"].status is Status.PASS
    assert rows_for(tmp_path, plain, "--quantization", "fp8")["model config"].status is Status.PASS  # at load


def test_hf_overrides_change_the_config_the_checks_read(tmp_path: Path) -> None:
    config = {**CONFIG, "rope_theta": "1e6"}
    model = write_model(tmp_path / "m", config)
    assert rows_for(tmp_path, model)["rope_theta"].status is Status.WARN  # its fix: pass --hf-overrides
    # A flat rope_theta override is one vLLM ignores (it reads rope_parameters): still a warning, naming the fix.
    flat = rows_for(tmp_path, model, "--hf-overrides", '{"rope_theta": 1000000}')
    assert flat["rope_theta"].status is Status.WARN and "is ignored" in flat["rope_theta"].measured
    assert '{"rope_parameters": {"rope_theta": 1000000}}' in flat["rope_theta"].fix
    assert "--hf-overrides rope_theta" in flat["model config"].measured
    fixed = rows_for(tmp_path, model, "--hf-overrides", '{"rope_parameters": {"rope_theta": 1000000}}')
    assert fixed["rope_theta"].status is Status.PASS and fixed["rope_theta"].measured == "1e+06"
    longer = rows_for(tmp_path, model, "--hf-overrides", '{"max_position_embeddings": 8192}', "--max-model-len", "8192")
    assert longer["context length"].status is Status.PASS
    broken = rows_for(tmp_path, model, "--hf-overrides", "rope_theta=1")["model config"]
    assert broken.blocks_start and "not a JSON object" in broken.measured


def test_download_dir_is_where_a_hub_id_is_found(tmp_path: Path) -> None:
    downloads = tmp_path / "downloads"
    repo = downloads / "models--nvidia--Nemotron-Mini-4B-Instruct"
    write_model(repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    hub_id = "nvidia/Nemotron-Mini-4B-Instruct"
    assert "not in the Hugging Face cache" in rows_for(tmp_path, hub_id)["model directory"].measured
    rows = rows_for(tmp_path, hub_id, "--download-dir", str(downloads))
    assert rows["model directory"].status is Status.PASS and "abc123" in rows["model directory"].measured
    assert str(downloads) in rows["disk for model cache"].measured
