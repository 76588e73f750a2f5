"""The stub engine with known delays, for the load tool's tests: TTFT and inter-token latency are what it injects."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from loadtest.processes import BenchProcess, free_port, python_argv

PREFILL_S = 0.05  # the stub's delay before the first token: the TTFT to measure
CHUNK_S = 0.01  # between two tokens: the inter-token latency to measure


@pytest.fixture(scope="module")
def stub_url() -> Iterator[str]:
    """Base URL of a stub engine answering after PREFILL_S, then one token every CHUNK_S."""
    port = free_port()
    argv = python_argv(
        "loadtest.stub_engine", "--port", str(port), "--chunk-delay", str(CHUNK_S), "--prefill-delay", str(PREFILL_S)
    )
    url = f"http://127.0.0.1:{port}"
    with BenchProcess("stub", argv, core=None) as engine:
        engine.wait_http(url + "/health")
        yield url
