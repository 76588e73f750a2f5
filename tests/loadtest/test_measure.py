"""vLLM's benchmark client through `nemotron-loadtest run`, against servers whose answers are known: the stub
engine's injected delays give TTFT, inter-token latency and latency; its lengths give goodput against objectives;
an odd server's refusals give the errors by reason."""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import statistics
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any, ClassVar

import pytest

from loadtest.cli import main
from loadtest.points import Target, TargetError, fetch_model
from tests.loadtest.conftest import CHUNK_S, PREFILL_S, threaded_http_server

pytestmark = pytest.mark.timeout(300)  # each run starts vLLM's client: tens of seconds on a loaded machine

TOKENS = 10
RANGE_RATIO = 0.5  # output lengths 5..15 tokens, so latencies spread around the objective below
SLO_LATENCY_MS = round((PREFILL_S + (TOKENS - 1) * CHUNK_S) * 1000, 3)
# A stub cannot be early: its delays bound every figure from below (less a millisecond of rounding). From above,
# a figure is bracketed by the others of the same requests (a busy machine makes them all late), not by the clock.
EARLY_MS = 1.0


def _run(argv: list[str], out: Path) -> dict[str, Any]:
    with contextlib.redirect_stdout(io.StringIO()):
        assert main([*argv, "--out", str(out)]) == 0
    return dict(json.loads((out / "results.json").read_text())["points"][0])


@pytest.fixture(scope="module")
def closed_loop(stub_url: str, demo_model: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One closed-loop point against the stub: completions, lengths spread, TTFT and latency objectives."""
    argv = [
        "run", "--base-url", stub_url + "/v1", "--tokenizer", demo_model, "--endpoint", "completions",
        "--concurrency", "4", "--requests", "24", "--warmup", "2", "--input-len", "16",
        "--max-tokens", str(TOKENS), "--range-ratio", str(RANGE_RATIO), "--ignore-eos",
        "--slo-ttft", "1000", "--slo-latency", f"{SLO_LATENCY_MS:g}",
    ]  # fmt: skip
    return _run(argv, tmp_path_factory.mktemp("closed"))


def test_ttft_and_inter_token_latency_match_the_injected_delays(closed_loop: dict[str, Any]) -> None:
    s = closed_loop["summary"]
    assert (s["completed"], s["failed"], s["errors"]) == (24, 0, {})
    assert s["ttft_ms"]["p50"] >= PREFILL_S * 1000 - EARLY_MS
    assert s["itl_ms"]["p50"] >= CHUNK_S * 1000 - EARLY_MS and s["tpot_ms"]["p50"] >= CHUNK_S * 1000 - EARLY_MS
    requests = closed_loop["requests"]
    lengths = [r["output_tokens"] for r in requests]
    assert len(requests) == 24 and sum(lengths) == s["output_tokens"]
    assert min(lengths) < TOKENS < max(lengths) and all(5 <= n <= 15 for n in lengths)
    # The stub's first token after PREFILL_S, then one every CHUNK_S: each request's latency follows its length.
    excess = [r["latency_ms"] - (PREFILL_S + (r["output_tokens"] - 1) * CHUNK_S) * 1000 for r in requests]
    assert min(excess) >= -EARLY_MS
    # The percentiles are the requests' own figures, in milliseconds: TTFT and latency their medians, TPOT the
    # median of each request's decode time per token after the first, an inter-token gap within a decode.
    ttfts, latencies = [r["ttft_ms"] for r in requests], [r["latency_ms"] for r in requests]
    decodes = [r["latency_ms"] - r["ttft_ms"] for r in requests]
    tpots = [decode / (r["output_tokens"] - 1) for decode, r in zip(decodes, requests, strict=True)]
    assert s["ttft_ms"]["p50"] == pytest.approx(statistics.median(ttfts), abs=0.01)
    assert s["e2el_ms"]["p50"] == pytest.approx(statistics.median(latencies), abs=0.01)
    assert s["tpot_ms"]["p50"] == pytest.approx(statistics.median(tpots), abs=0.01)
    assert s["itl_ms"]["p50"] <= max(decodes)


def test_goodput_counts_only_requests_within_the_objectives(closed_loop: dict[str, Any]) -> None:
    goodput = closed_loop["summary"]["goodput"]
    assert (goodput["slo_ttft_ms"], goodput["slo_e2el_ms"]) == (1000, SLO_LATENCY_MS)
    within = [r for r in closed_loop["requests"] if r["ttft_ms"] <= 1000 and r["latency_ms"] <= SLO_LATENCY_MS]
    # The longest answers are outside the latency objective by the stub's own delays, however fast the machine.
    assert len(within) < 24, "the latency objective was not applied"
    assert goodput["requests"] == len(within) and goodput["fraction"] == pytest.approx(len(within) / 24)
    assert goodput["per_s"] == pytest.approx(len(within) / closed_loop["summary"]["duration_s"], rel=0.01)


def test_the_clients_own_cpu_is_recorded(closed_loop: dict[str, Any]) -> None:
    client = closed_loop["client"]
    assert client["returncode"] == 0 and not client["timed_out"]
    # Importing vLLM alone costs the client seconds of CPU; while it sent, a small share of one core.
    assert client["cpu_s"] > 1.0 and client["wall_s"] > closed_loop["summary"]["duration_s"]
    assert client["run_cpu_share"] is not None and 0 < client["run_cpu_share"] < 1.5
    assert client["bound"] == (client["run_cpu_share"] >= 0.9)


def test_the_model_comes_from_v1_models(stub_url: str) -> None:
    assert fetch_model(Target.from_url(stub_url + "/v1/")) == "bench-model"
    with pytest.raises(TargetError, match="answered 404"):
        fetch_model(Target.from_url(stub_url + "/nothing"))


KEY = "sk-loadtest-0123456789abcdef"
EMPTY_STREAM = "Never received a valid chunk to calculate TTFT.This response will be marked as failed!"


class _OddHandler(BaseHTTPRequestHandler):
    """Answers in turn: 429, 500, a stream with no token, a stream of three tokens; keeps every prompt it got."""

    protocol_version = "HTTP/1.0"  # the body ends when the connection closes
    turns = itertools.count()
    prompts: ClassVar[list[str]] = []
    authorizations: ClassVar[set[str | None]] = set()

    def do_POST(self) -> None:
        self.prompts.append(json.loads(self.rfile.read(int(self.headers["Content-Length"])))["prompt"])
        self.authorizations.add(self.headers.get("Authorization"))
        turn = next(self.turns) % 4
        if turn < 2:
            self.send_error(429 if turn == 0 else 500)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        chunk = {"choices": [{"index": 0, "text": "a", "finish_reason": None}]}
        usage = {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3}}
        events = [chunk] * 3 + [usage] if turn == 3 else []
        for event in events:
            self.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, format: str, *args: Any) -> None:  # quiet: the test reads no access log
        pass


@pytest.fixture(scope="module")
def odd_server() -> Iterator[str]:
    with threaded_http_server(_OddHandler) as url:
        yield url


def test_errors_by_reason_a_prompts_file_as_written_and_the_key_sent_but_never_written(
    odd_server: str, demo_model: str, tmp_path: Path
) -> None:
    written = [f"Prompt number {i}: say something." for i in range(8)]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": text}) + "\n" for text in written))
    argv = [
        "run", "--base-url", odd_server, "--model", "odd", "--tokenizer", demo_model, "--endpoint", "completions",
        "--concurrency", "2", "--requests", "8", "--warmup", "0", "--prompts", str(prompts), "--max-tokens", "3",
        "--no-metrics", "--api-key", KEY,
    ]  # fmt: skip
    point = _run(argv, tmp_path / "out")
    assert sorted(_OddHandler.prompts) == sorted(written), "each line once, its text unchanged"
    assert _OddHandler.authorizations == {f"Bearer {KEY}"}
    saved = [path for path in (tmp_path / "out").rglob("*") if path.is_file()]
    assert any(path.suffix == ".log" for path in saved), "vLLM's client log is kept"
    assert not [path for path in saved if KEY.encode() in path.read_bytes()], "the key is in no output"
    s = point["summary"]
    assert (s["completed"], s["failed"]) == (2, 6)
    assert s["errors"] == {"Too Many Requests": 2, "Internal Server Error": 2, EMPTY_STREAM: 2}
    failed = [r for r in point["requests"] if r["error"] is not None]
    assert len(failed) == 6 and all(r["ttft_ms"] is None and r["latency_ms"] is None for r in failed)
    assert [r["output_tokens"] for r in point["requests"] if r["error"] is None] == [3, 3]
    assert s["goodput"]["requests"] is None, "no objective set: no goodput"
