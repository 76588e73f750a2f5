"""The load tool's pieces on their own: prompts and bodies, the SSE reading of odd streams, metrics parsing,
aggregates, the live progress text."""

from __future__ import annotations

import asyncio
import random
import statistics
from collections.abc import AsyncIterator
from pathlib import Path

import orjson
import pytest
from aiohttp import web

from loadtest.loadgen import Phase, open_session
from loadtest.progress import LiveProgress
from loadtest.summary import Objectives, summarize
from loadtest.telemetry import Snapshot, metrics_delta, parse_metrics, server_side
from loadtest.timing import RequestTiming, timed_request
from loadtest.traffic import (
    FilePrompts,
    PromptFileError,
    SyntheticPrompts,
    Traffic,
    parse_list,
    parse_token_range,
)
from tests.procs import free_port

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("distribution", ["normal", "lognormal", "uniform", "exponential"])
def test_synthetic_prompt_lengths_follow_the_distribution(distribution: str) -> None:
    prompts = SyntheticPrompts(mean=100, stddev=100 if distribution == "exponential" else 20, distribution=distribution)
    rng = random.Random(1)
    lengths = [prompts.length(rng) for _ in range(4000)]
    assert statistics.mean(lengths) == pytest.approx(100, rel=0.05)
    assert statistics.stdev(lengths) == pytest.approx(prompts.stddev, rel=0.12)
    assert len(prompts.prompt(random.Random(2)).as_text().split()) == prompts.length(random.Random(2))
    assert SyntheticPrompts(mean=50, stddev=9, distribution="fixed").length(rng) == 50


def test_bodies_are_reproducible_and_ask_for_usage() -> None:
    traffic = Traffic(model="m", max_tokens=(4, 40), seed=7)
    assert traffic.body(3) == Traffic(model="m", max_tokens=(4, 40), seed=7).body(3)
    assert traffic.body(3) != traffic.body(4)
    body = orjson.loads(traffic.body(0))
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["messages"][0]["role"] == "user" and 4 <= body["max_tokens"] <= 40
    plain = orjson.loads(Traffic(model="m", endpoint="completions", stream=False, ignore_eos=True).body(0))
    assert "stream" not in plain and isinstance(plain["prompt"], str) and plain["ignore_eos"] is True


def test_prompts_file(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    lines = [
        {"prompt": "Say hi"},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], "max_tokens": 3},
    ]
    path.write_text("\n".join(orjson.dumps(line).decode() for line in lines) + "\n\n")
    prompts = FilePrompts.load(path)
    assert len(prompts.prompts) == 2 and prompts.prompt(2) == prompts.prompt(0)
    chat = orjson.loads(Traffic(model="m", prompts=prompts).body(1))
    assert chat["messages"][0]["content"] == "Be brief." and chat["max_tokens"] == 3
    text = orjson.loads(Traffic(model="m", prompts=prompts, endpoint="completions").body(1))
    assert text["prompt"] == "Be brief.\nHi"
    assert orjson.loads(Traffic(model="m", prompts=prompts).body(0))["messages"] == [
        {"role": "user", "content": "Say hi"}
    ]
    path.write_text('{"text": "no"}\n')
    with pytest.raises(PromptFileError, match=r"p.jsonl:1: needs"):
        FilePrompts.load(path)


def test_ranges_and_lists() -> None:
    assert parse_token_range("64") == (64, 64) and parse_token_range("16:128") == (16, 128)
    for bad in ("0", "9:3", "x"):
        with pytest.raises(ValueError):
            parse_token_range(bad)
    assert parse_list("1,2, 4", int) == [1, 2, 4] and parse_list("0.5,2", float) == [0.5, 2.0]
    with pytest.raises(ValueError):
        parse_list("1,0", int)


GATEWAY_METRICS = """# HELP nemotron_gateway_requests_total Requests answered, by route and HTTP status.
# TYPE nemotron_gateway_requests_total counter
nemotron_gateway_requests_total{route="/v1/chat/completions",status="200"} %d
nemotron_gateway_requests_total{route="/v1/chat/completions",status="429"} 1.0
nemotron_gateway_requests_total{route="/metrics",status="200"} %d
# TYPE nemotron_gateway_time_to_first_token_seconds histogram
nemotron_gateway_time_to_first_token_seconds_bucket{le="0.1"} 3.0
nemotron_gateway_time_to_first_token_seconds_bucket{le="+Inf"} %d
nemotron_gateway_time_to_first_token_seconds_count %d
nemotron_gateway_time_to_first_token_seconds_sum %f
# TYPE nemotron_gateway_requests_in_flight gauge
nemotron_gateway_requests_in_flight 2.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="nemotron"} 1.0
# TYPE other_total counter
other_total 5.0
"""


def test_metrics_parsing_and_deltas() -> None:
    before = parse_metrics(GATEWAY_METRICS % (10, 1, 10, 10, 1.0))
    after = parse_metrics(GATEWAY_METRICS % (30, 2, 30, 30, 3.0))
    assert before['nemotron_gateway_requests_total{route="/v1/chat/completions",status="200"}'] == 10
    assert before['vllm:num_requests_running{engine="0",model_name="nemotron"}'] == 1
    assert not any(k.startswith(("other", "nemotron_gateway_time_to_first_token_seconds_bucket")) for k in before)
    delta = metrics_delta(Snapshot(0, before, None), Snapshot(1, after, None))
    assert delta is not None and "nemotron_gateway_requests_in_flight" not in delta
    assert delta['nemotron_gateway_requests_total{route="/v1/chat/completions",status="200"}'] == 20
    derived = server_side(delta)
    assert derived["gateway_requests"] == 20, "the API routes only, not the scrapes of /metrics"
    assert derived["gateway_ttft_mean_ms"] == pytest.approx(100) and "engine_preemptions" not in derived
    assert metrics_delta(Snapshot(0, None, None), Snapshot(1, after, None)) is None


def _record(index: int, *, latency: float, ttft: float | None, outcome: str = "ok") -> RequestTiming:
    return RequestTiming(index, 0.0, 0.0, outcome=outcome, latency=latency, ttft=ttft, output_tokens=5)


def test_summary_percentiles_goodput_and_errors() -> None:
    records = [_record(i, latency=(i + 1) / 100, ttft=(i + 1) / 1000) for i in range(100)]
    records += [_record(100, latency=0.5, ttft=None, outcome="429"), _record(101, latency=0, ttft=None, outcome="429")]
    s = summarize(Phase(records, wall_s=2.0), Objectives(ttft_ms=50, latency_ms=400))
    assert s.requests == 102 and s.ok == 100 and s.errors == {"429": 2}
    assert (s.latency_ms.p50, s.latency_ms.p90, s.latency_ms.p99, s.latency_ms.max) == (500, 900, 990, 1000)
    assert s.ttft_ms.p50 == 50 and s.requests_per_s == 50 and s.output_tokens_per_s == 250
    assert s.goodput.requests == 40 and s.goodput.per_s == 20  # latency <= 400 ms and TTFT <= 50 ms
    empty = summarize(Phase([], wall_s=0.0), Objectives())
    assert empty.latency_ms.p50 is None and empty.goodput.fraction is None


def test_live_progress_text() -> None:
    progress = LiveProgress("c=1", 3, enabled=False)
    with progress:
        progress.record(_record(0, latency=0.2, ttft=0.05))
        progress.record(_record(1, latency=0.004, ttft=None))
        progress.record(_record(2, latency=1, ttft=None, outcome="timeout"))
    assert progress.live_text() == "lat p50 4.0 ms p99 200 ms | ttft p50 50 ms p99 50 ms | errors 1"


def _sse(*events: object, done: bool = True) -> bytes:
    lines = [b"data: " + (e if isinstance(e, bytes) else orjson.dumps(e)) + b"\n\n" for e in events]
    return b"".join(lines) + (b"data: [DONE]\n\n" if done else b"")


ROLE = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
TOKEN = {"choices": [{"index": 0, "delta": {"content": "a"}}]}
THINK = {"choices": [{"index": 0, "delta": {"reasoning_content": "hm"}}]}
HELD_BACK = {"choices": [{"index": 0, "delta": {"content": ""}}]}  # a token whose text is not complete yet
LAST = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}  # OpenAI's closing chunk: no token
STREAMS = {
    "/plain": _sse(ROLE, THINK, HELD_BACK, TOKEN, LAST),
    "/usage": _sse(ROLE, TOKEN, TOKEN, {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 9}}),
    "/error": _sse(ROLE, TOKEN, {"error": {"message": "engine went away", "type": "service_unavailable"}}),
    "/cut": _sse(ROLE, TOKEN, done=False),
    "/garbage": _sse(ROLE, b"{not json"),
}


@pytest.fixture
async def odd_server() -> AsyncIterator[str]:
    async def handler(request: web.Request) -> web.StreamResponse:
        if request.path == "/slow":
            await asyncio.sleep(0.5)
        return web.Response(body=STREAMS.get(request.path, b""), content_type="text/event-stream")

    app = web.Application()
    app.router.add_route("POST", "/{name}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@pytest.mark.parametrize(
    ("path", "outcome", "tokens", "prompt_tokens"),
    [
        ("/plain", "ok", 3, None),  # no usage chunk: the token events are counted; the role chunk is not one
        ("/usage", "ok", 9, 7),
        ("/error", "stream_error", 1, None),
        ("/cut", "incomplete", 1, None),
        ("/garbage", "protocol", 0, None),
    ],
)
async def test_odd_streams(odd_server: str, path: str, outcome: str, tokens: int, prompt_tokens: int | None) -> None:
    async with open_session(connections=1, timeout=5, headers={}) as http:
        record = await timed_request(http, odd_server + path, b"{}", stream=True, record=RequestTiming(0, 0, 0))
    assert (record.outcome, record.status, record.prompt_tokens) == (outcome, 200, prompt_tokens)
    assert record.output_tokens == tokens or outcome in ("stream_error", "protocol")
    if outcome == "ok":
        assert record.ttft is not None and len(record.gaps) == (2 if path == "/plain" else 1)
    if outcome == "stream_error":
        assert "engine went away" in (record.detail or "")


async def test_a_timeout_is_its_own_outcome(odd_server: str) -> None:
    async with open_session(connections=1, timeout=0.1, headers={}) as http:
        record = await timed_request(http, odd_server + "/slow", b"{}", stream=True, record=RequestTiming(0, 0, 0))
    assert (record.outcome, record.status, record.ttft) == ("timeout", 0, None)
    assert 0.1 <= record.latency < 0.4
