"""The stub engine with known delays, for the load tool's tests: TTFT and inter-token latency are what it injects;
the tiny demo model, whose tokenizer vLLM's benchmark client makes its prompts with (and `profiles` serves); a
small HTTP server of a test's own answers."""

from __future__ import annotations

import contextlib
import importlib.util
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from loadtest.processes import BenchProcess, free_port, python_argv
from tests.procs import REPO_ROOT

PREFILL_S = 0.05  # the stub's delay before the first token: the TTFT to measure
CHUNK_S = 0.01  # between two tokens: the inter-token latency to measure
CACHE_ROOT = REPO_ROOT / ".cache"


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


@pytest.fixture(scope="session")
def demo_model() -> str:
    """The demo model the engine tier uses (written by a child: torch stays out of this process)."""
    if importlib.util.find_spec("vllm") is None:
        pytest.fail("vLLM is not installed in this venv: run scripts/install-engine-cpu", pytrace=False)
    code = (
        "import sys; from pathlib import Path; from tests.engine._vllm import ensure_demo_model as ensure; "
        "print(ensure(Path(sys.argv[1])))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(CACHE_ROOT)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return done.stdout.strip().splitlines()[-1]


@contextlib.contextmanager
def threaded_http_server(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """Base URL of a stdlib HTTP server answering with `handler`, in a thread of this process."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
