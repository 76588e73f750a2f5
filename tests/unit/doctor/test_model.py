"""Model-directory checks on directories written to tmp: weights, config, tokenizer, template, BOS, rope, context."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gateway.doctor.check import Check, Status
from gateway.doctor.model import ModelFlags, check_bos, check_model_dir, check_rope_theta, resolve_model
from gateway.doctor.report import fatal_failures
from gateway.doctor.runner import hub_cache
from tests.unit.doctor.samples import CONFIG, TEMPLATE_NO_BOS, TEMPLATE_WITH_BOS, TOKENIZER_CONFIG, by_name, write_model

pytestmark = pytest.mark.timeout(30)


def model_rows(path: Path, max_model_len: int = 4096, **flags: Any) -> dict[str, Check]:
    return by_name(check_model_dir(path, ModelFlags(max_model_len, **flags)))


def test_complete_model_dir_passes(tmp_path: Path) -> None:
    checks = model_rows(write_model(tmp_path / "m"))
    assert {c.status for c in checks.values()} == {Status.PASS}, checks
    assert set(checks) == {
        "model directory",
        "model config",
        "tokenizer",
        "chat template",
        "reasoning parser",
        "BOS token",
        "rope_theta",
        "context length",
    }
    assert [n for n, c in checks.items() if c.fatal] == [
        "model directory",
        "model config",
        "tokenizer",
        "reasoning parser",
        "context length",
    ]


def test_missing_model_dir_is_fatal_and_skips_the_rest(tmp_path: Path) -> None:
    checks = check_model_dir(tmp_path / "absent", ModelFlags(4096))
    assert checks[0].blocks_start and "no such directory" in checks[0].measured
    assert {c.status for c in checks[1:]} == {Status.SKIP}


def test_model_dir_without_config_is_fatal(tmp_path: Path) -> None:
    checks = model_rows(write_model(tmp_path / "m", config=None))
    assert checks["model config"].blocks_start and "missing" in checks["model config"].measured
    assert checks["context length"].status is Status.SKIP


def test_model_dir_without_weights_or_with_missing_shards_fails(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    assert check_model_dir(empty, ModelFlags(4096))[0].blocks_start
    sharded = write_model(tmp_path / "sharded")
    index = {"metadata": {"total_size": 10}, "weight_map": {"a": "model.safetensors", "b": "model-00002.safetensors"}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    first = check_model_dir(sharded, ModelFlags(4096))[0]
    assert first.blocks_start and "1 of 2 shards missing" in first.measured


def test_model_dir_without_tokenizer_fails(tmp_path: Path) -> None:
    checks = model_rows(write_model(tmp_path / "m", tokenizer=False))
    assert checks["tokenizer"].blocks_start and "--tokenizer" in checks["tokenizer"].fix
    base = write_model(tmp_path / "base")
    with_base = model_rows(tmp_path / "m", tokenizer_dir=base)
    assert with_base["tokenizer"].status is Status.PASS


def test_chat_template_absent_warns(tmp_path: Path) -> None:
    no_template = {k: v for k, v in TOKENIZER_CONFIG.items() if k != "chat_template"}
    checks = model_rows(write_model(tmp_path / "m", tokenizer_config=no_template))
    assert checks["chat template"].status is Status.WARN and "--chat-template" in checks["chat template"].fix


def test_chat_template_from_other_places(tmp_path: Path) -> None:
    no_template = {k: v for k, v in TOKENIZER_CONFIG.items() if k != "chat_template"}
    jinja = write_model(tmp_path / "jinja", tokenizer_config=no_template)
    (jinja / "chat_template.jinja").write_text(TEMPLATE_NO_BOS)
    assert model_rows(jinja)["chat template"].status is Status.PASS
    named = {**TOKENIZER_CONFIG, "chat_template": [{"name": "default", "template": TEMPLATE_NO_BOS}]}
    assert model_rows(write_model(tmp_path / "list", tokenizer_config=named))["chat template"].status is Status.PASS
    override = tmp_path / "nemotron.jinja"
    override.write_text(TEMPLATE_NO_BOS)
    bare = write_model(tmp_path / "bare", tokenizer_config=no_template)
    assert model_rows(bare, chat_template=override)["chat template"].status is Status.PASS
    missing = model_rows(bare, chat_template=tmp_path / "none.jinja")["chat template"]
    assert missing.status is Status.FAIL


def test_add_bos_token_with_a_template_that_writes_bos_warns(tmp_path: Path) -> None:
    double = {**TOKENIZER_CONFIG, "add_bos_token": True}
    check = model_rows(write_model(tmp_path / "m", tokenizer_config=double))["BOS token"]
    assert check.status is Status.WARN and "double BOS" in check.fix
    literal = check_bos("<s>", True, "<s>{% for m in messages %}{{ m.content }}{% endfor %}")
    assert literal.status is Status.WARN
    assert check_bos("<s>", True, TEMPLATE_NO_BOS).status is Status.PASS
    assert check_bos(None, None, TEMPLATE_WITH_BOS).status is Status.PASS


def test_bos_added_by_the_tokenizer_json_post_processor(tmp_path: Path) -> None:
    unset = {k: v for k, v in TOKENIZER_CONFIG.items() if k != "add_bos_token"}
    model = write_model(tmp_path / "m", tokenizer_config=unset)
    processor = {
        "type": "Sequence",
        "processors": [
            {"type": "ByteLevel"},
            {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}]},
        ],
    }
    (model / "tokenizer.json").write_text(json.dumps({"post_processor": processor}))
    check = model_rows(model)["BOS token"]
    assert check.status is Status.WARN and "tokenizer adds it: True" in check.measured


def test_max_model_len_above_the_model_fails(tmp_path: Path) -> None:
    check = model_rows(write_model(tmp_path / "m"), 8192)["context length"]
    assert check.blocks_start and "model allows 4096" in check.measured and "4096" in check.fix


def test_context_length_follows_rope_scaling(tmp_path: Path) -> None:
    yarn = {**CONFIG, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}}
    assert "allows 16384" in model_rows(write_model(tmp_path / "y", yarn), 16384)["context length"].measured
    llama3 = {**CONFIG, "max_position_embeddings": 131072, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    assert "allows 131072" in model_rows(write_model(tmp_path / "l", llama3))["context length"].measured
    limited = {**TOKENIZER_CONFIG, "model_max_length": 2048}
    check = model_rows(write_model(tmp_path / "t", tokenizer_config=limited))["context length"]
    assert check.status is Status.FAIL
    nameless = {k: v for k, v in CONFIG.items() if k != "max_position_embeddings"}
    assert model_rows(write_model(tmp_path / "n", nameless))["context length"].status is Status.WARN


@pytest.mark.parametrize(
    ("value", "status"),
    [
        (10000, Status.PASS),
        (500000.0, Status.PASS),
        (None, Status.PASS),
        ("1e6", Status.WARN),
        (1.0, Status.WARN),
        (1e12, Status.WARN),
        (True, Status.WARN),
    ],
)
def test_rope_theta(value: object, status: Status) -> None:
    assert check_rope_theta(value).status is status


def test_rope_theta_inside_rope_parameters(tmp_path: Path) -> None:
    config = {k: v for k, v in CONFIG.items() if k != "rope_theta"}
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": "10000"}
    check = model_rows(write_model(tmp_path / "m", config))["rope_theta"]
    assert check.status is Status.WARN and "not a number" in check.measured


def test_hub_ids_resolve_through_the_cache(tmp_path: Path) -> None:
    repo = tmp_path / "hub" / "models--nvidia--Nemotron-Mini-4B-Instruct"
    write_model(repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    assert resolve_model("nvidia/Nemotron-Mini-4B-Instruct", tmp_path / "hub") == repo / "snapshots" / "abc123"
    assert resolve_model("nvidia/not-downloaded", tmp_path / "hub") is None
    assert resolve_model(str(tmp_path / "x"), tmp_path / "hub") == tmp_path / "x"
    checks = check_model_dir(None, ModelFlags(4096), model="nvidia/not-downloaded")
    assert checks[0].status is Status.WARN and not fatal_failures(checks)


def test_hub_cache_follows_huggingface_variables(tmp_path: Path) -> None:
    assert hub_cache({"HF_HUB_CACHE": str(tmp_path)}) == tmp_path
    assert hub_cache({"HF_HOME": str(tmp_path)}) == tmp_path / "hub"
    assert hub_cache({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "huggingface" / "hub"
