"""The session's real `vllm serve` (CPU build) on the tiny demo model; see tests/engine/_vllm.py for the launch."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from tests.engine import _vllm
from tests.procs import REPO_ROOT, free_port

logger = logging.getLogger(__name__)

CACHE_ROOT = REPO_ROOT / ".cache"


@pytest.fixture(scope="session")
def vllm_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_vllm.VllmEngine]:
    """One engine for the whole session; tests that use it need `pytest.mark.timeout(300)` for the start-up."""
    if not _vllm.vllm_installed():
        pytest.fail("vLLM is not installed in this venv: run scripts/install-engine-cpu", pytrace=False)
    model_dir = _vllm.ensure_demo_model(CACHE_ROOT)
    work_dir = tmp_path_factory.mktemp("vllm-engine")
    port = free_port()
    proc = _vllm.start_engine(model_dir, port, work_dir, CACHE_ROOT)
    base_url = f"http://127.0.0.1:{port}"
    log_path = work_dir / "engine.log"
    try:
        seconds = _vllm.wait_ready(proc, base_url, log_path)
        logger.info("vllm serve ready on %s after %.1f s (log %s)", base_url, seconds, log_path)
        yield _vllm.VllmEngine(
            base_url=base_url, model_name=_vllm.MODEL_NAME, model_dir=model_dir, log_path=log_path, pid=proc.pid
        )
    finally:
        _vllm.stop_engine(proc, work_dir)
