"""The real-vLLM tier: the CPU build of vLLM on the tiny demo model, started by the project's own supervisor."""

from __future__ import annotations

import pytest

from tests.engine import _vllm
from tests.procs import REPO_ROOT

CACHE_ROOT = REPO_ROOT / ".cache"


@pytest.fixture(scope="session")
def demo_model_dir() -> str:
    """The demo model directory (written on first use, reused while tools/demo_model.py is unchanged)."""
    if not _vllm.vllm_installed():
        pytest.fail("vLLM is not installed in this venv: run scripts/install-engine-cpu", pytrace=False)
    return str(_vllm.ensure_demo_model(CACHE_ROOT))
