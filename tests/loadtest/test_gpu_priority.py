"""The GPU priority step's own reading of what it meets: vLLM's queue from /metrics, and a shed answer judged
well-formed only with its 429/503 status, OpenAI's error envelope and Retry-After (real HTTP servers)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler

import pytest

from loadtest.gpu import priority
from tests.loadtest.conftest import threaded_http_server
from tests.procs import wait_until

pytestmark = pytest.mark.timeout(30)

METRICS = (
    "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
    'vllm:num_requests_running{engine="0",model_name="nemotron"} 250.0\n'
    'vllm:num_requests_running{engine="1",model_name="nemotron"} 6.0\n'
    'vllm:num_requests_waiting{engine="0",model_name="nemotron"} 300.0\n'
    'vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 999.0\n'
)
ENVELOPE = {"error": {"message": "busy", "type": "rate_limit_error", "param": None, "code": "rate_limit_exceeded"}}
ANSWERS: dict[str, tuple[int, dict[str, str], bytes]] = {
    "/shed/v1/chat/completions": (429, {"Retry-After": "1"}, json.dumps(ENVELOPE).encode()),
    "/bare/v1/chat/completions": (503, {}, json.dumps(ENVELOPE).encode()),
    "/text/v1/chat/completions": (429, {"Retry-After": "1"}, b"Too Many Requests"),
}


# The engine's output tokens grow at this many per second of CLOCK (a counter, as vLLM's).
TOKENS_PER_S = 1000.0


class _Clock:
    """The seconds both the server's counter and the sampler read: moved by the test alone."""

    now = 0.0

    def monotonic(self) -> float:
        return self.now


CLOCK = _Clock()


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        generated = TOKENS_PER_S * CLOCK.now
        counter = f'vllm:generation_tokens_total{{engine="0",model_name="nemotron"}} {generated}\n'
        self._answer(200, {}, (METRICS + counter).encode())

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self._answer(*ANSWERS[self.path])

    def _answer(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with threaded_http_server(_Handler) as url:
        yield url


def test_the_engine_queue_sums_vllms_gauges_over_engines(server: str) -> None:
    assert priority.engine_queue(server) == (256.0, 300.0)
    assert priority.engine_queue("http://127.0.0.1:9") == (-1.0, -1.0)


def test_the_sampler_reads_the_engines_output_tokens_per_second_over_its_window(
    server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The sampler's clock is the one the server's counter grows by: the rate is exact however late each read is.
    monkeypatch.setattr(priority, "time", CLOCK)
    CLOCK.now = 100.0
    sampler = priority.QueueSampler(server).start()
    wait_until(lambda: len(sampler.samples) >= 2, timeout=30, message="the sampler took no samples")
    CLOCK.now += 2.5
    queue = sampler.stop()
    assert queue["running_median"] == 256 and queue["waiting_max"] == 300
    assert queue["output_tokens_per_s"] == TOKENS_PER_S
    assert priority.QueueSampler("http://127.0.0.1:9").start().stop()["output_tokens_per_s"] == -1


def test_each_reserve_gateway_is_a_loaded_phase_of_its_own() -> None:
    args = argparse.Namespace(gateway="http://g:8000", reserve_gateway=["64=http://g:8010", "128=http://g:8011"])
    assert priority.loaded_gateways(args) == {
        "gateway-loaded": "http://g:8000",
        "gateway-loaded-r64": "http://g:8010",
        "gateway-loaded-r128": "http://g:8011",
    }
    assert priority.loaded_phases(args)[-1] == "direct-loaded"


def test_a_shed_answer_is_well_formed_only_with_envelope_and_retry_after(server: str) -> None:
    shed = priority.probe_once(f"{server}/shed", "k", "nemotron")
    assert shed["status"] == 429 and shed["retry_after"] == "1" and shed["well_formed"] and shed["ms"] > 0
    assert not priority.probe_once(f"{server}/bare", "k", "nemotron")["well_formed"]  # no Retry-After
    assert not priority.probe_once(f"{server}/text", "k", "nemotron")["well_formed"]  # not the envelope


def test_the_tables_judge_the_loaded_p99_against_the_unloaded_one() -> None:
    phases = {
        "alone": {"interactive": {"completed": 320, "failed": 0, "ttft_p50_ms": 20.0, "ttft_p99_ms": 40.0}},
        "gateway-loaded": {
            "interactive": {"completed": 320, "failed": 0, "ttft_p50_ms": 30.0, "ttft_p99_ms": 70.0},
            "engine_queue": {"running_median": 256, "waiting_median": 256, "waiting_max": 300},
            "batch": {"output_tokens_per_s": 15000.0, "completed": 1200, "failed": 800},
        },
        "overload-gateway": {
            "rate": 450.0, "completed": 3000, "failed": 6000, "good_requests": 2900, "request_goodput": 145.0,
            "ttft_p50_ms": 200.0, "ttft_p99_ms": 900.0, "errors": {"Too Many Requests": 6000},
            "shed_probe": {"shed": 60, "probes": 100, "statuses": {"200": 40, "429": 60}, "shed_well_formed": 60,
                           "shed_ms_p50": 1.2, "shed_ms_p99": 3.4, "shed_ms_max": 5.0},
        },
    }  # fmt: skip
    phases["gateway-loaded-r64"] = {
        "interactive": {"completed": 320, "failed": 0, "ttft_p50_ms": 22.0, "ttft_p99_ms": 50.0,
                        "output_tokens_per_s": 100.0},
        "engine_queue": {"running_median": 190, "waiting_median": 0, "waiting_max": 0, "output_tokens_per_s": 9100.0},
        "batch": {"completed": None},
    }  # fmt: skip
    table = priority.markdown(phases, ["a note"])
    # A reserve's own row; the batch stopped mid-run has no count of its own: the engine's tokens less interactive.
    assert (
        "| gateway-loaded-r64 | 320/0 | 22.0 / 50.0 | 1.25x | 190 / 0, 0 | 9000.0 (engine, less interactive) |" in table
    )
    # The batch column: its tokens/s, and what was served and refused (the reserve sheds batch requests).
    loaded = "| gateway-loaded | 320/0 | 30.0 / 70.0 | 1.75x | 256 / 256, 300 | 15000.0 (1200 ok / 800 refused) |"
    assert loaded in table
    assert "| overload-gateway | 450.0 | 3000 / 6000 | 2900 | 145.0 | 200.0 / 900.0 |" in table
    assert "60 of 100 probes refused" in table and "60 well-formed" in table and "- a note" in table
