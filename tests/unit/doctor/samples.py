"""Shared material for the doctor's tests: a model directory on disk, an H200 reading, a config for this machine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gateway.doctor.check import Check
from gateway.doctor.runner import DoctorConfig
from gateway.engine.nvml import GpuDevice, PcieLink
from tests.procs import free_port

GiB = 2**30
TEMPLATE_WITH_BOS = "{{ bos_token }}{% for m in messages %}<extra_id_1>{{ m.role }}\n{{ m.content }}{% endfor %}"
TEMPLATE_NO_BOS = "{% for m in messages %}<extra_id_1>{{ m.role }}\n{{ m.content }}{% endfor %}"


def by_name(checks: list[Check]) -> dict[str, Check]:
    return {c.name: c for c in checks}


CONFIG: dict[str, Any] = {
    "architectures": ["NemotronForCausalLM"],
    "model_type": "nemotron",
    "max_position_embeddings": 4096,
    "rope_theta": 10000,
    # The sizes vLLM's ModelConfig needs to accept the config (the doctor asks it where vLLM is installed).
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 2,
    "head_dim": 32,
    "vocab_size": 1024,
}
TOKENIZER_CONFIG: dict[str, Any] = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": "<s>",
    "add_bos_token": False,
    "chat_template": TEMPLATE_WITH_BOS,
}


def write_model(
    root: Path,
    config: dict[str, Any] | None = CONFIG,
    tokenizer_config: dict[str, Any] | None = TOKENIZER_CONFIG,
    tokenizer: bool = True,
) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    # A valid, empty safetensors file (header length, then a `{}` header): vLLM reads its header for the dtype.
    (root / "model.safetensors").write_bytes(len(b"{}").to_bytes(8, "little") + b"{}")
    if config is not None:
        (root / "config.json").write_text(json.dumps(config))
    if tokenizer_config is not None:
        (root / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    if tokenizer:
        (root / "tokenizer.json").write_text(json.dumps({"version": "1.0", "post_processor": None}))
    return root


def h200(index: int = 0) -> GpuDevice:
    return GpuDevice(index, "NVIDIA H200", f"GPU-{index}abc", 140 * GiB, 141 * GiB, (9, 0), PcieLink(5, 16, 5, 16))


def doctor_config_for(tmp_path: Path, redis_url: str, **overrides: Any) -> DoctorConfig:
    values: dict[str, Any] = {
        "model": str(write_model(tmp_path / "model")),
        "max_model_len": 4096,
        "engine_port": free_port(),
        "redis_url": redis_url,
        "cache_dir": tmp_path / "hf",
        "cpu": True,
        "environ": {"HF_HUB_CACHE": str(tmp_path / "hf")},
    }
    return DoctorConfig(**{**values, **overrides})
