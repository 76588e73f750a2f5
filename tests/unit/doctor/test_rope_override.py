"""Proof, on vLLM's own config loader, of what the doctor's rope_theta row says: with transformers 5, a flat
`--hf-overrides '{"rope_theta": N}'` leaves the `rope_parameters` Nemotron's attention reads unchanged, and
`{"rope_parameters": {"rope_theta": N}}` changes them."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the cpu or gpu extra (vLLM) is not installed")

# vLLM's config module imports torch, which warns about its own deprecations (the suite makes warnings errors).
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from vllm.transformers_utils.config import get_config

from gateway.doctor.model import effective_rope_theta
from tests.unit.doctor.samples import CONFIG

pytestmark = pytest.mark.timeout(60)

NEMOTRON = {**CONFIG, "hidden_size": 128, "num_attention_heads": 4, "partial_rotary_factor": 0.5}


def loaded_theta(root: Path, overrides: dict[str, Any]) -> float:
    root.mkdir()
    (root / "config.json").write_text(json.dumps(NEMOTRON))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = get_config(str(root), trust_remote_code=False, hf_overrides_kw=overrides)
    return float(config.rope_parameters["rope_theta"])


def test_a_flat_rope_theta_override_changes_nothing_vllm_reads(tmp_path: Path) -> None:
    overrides = {"rope_theta": 20000.0}
    assert loaded_theta(tmp_path / "m", overrides) == 10000.0
    theta, warning = effective_rope_theta(NEMOTRON, overrides)
    assert theta == 10000 and warning is not None and "is ignored" in warning.measured


def test_a_rope_parameters_override_is_what_vllm_reads(tmp_path: Path) -> None:
    overrides = {"rope_parameters": {"rope_type": "default", "rope_theta": 20000.0}}
    assert loaded_theta(tmp_path / "m", overrides) == 20000.0
    assert effective_rope_theta(NEMOTRON, overrides) == (20000.0, None)
