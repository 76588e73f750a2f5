"""The GPU steps' use of vLLM's benchmark client: its command line, its saved results, each client's own CPU, and
the Responses backend given to a vLLM that has none (read against a real HTTP server streaming Responses events)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from loadtest.gpu import bench

pytestmark = pytest.mark.timeout(240)  # the Responses test imports vLLM: slow on a loaded machine


def _load(**overrides: object) -> bench.Load:
    fields: dict[str, object] = {
        "base_url": "http://127.0.0.1:8000", "tokenizer": "/tmp/model", "concurrency": 64, "prompts": 256,
        "input_len": 200, "output_len": 128, "seed": 7,
    }  # fmt: skip
    return bench.Load(**{**fields, **overrides})  # type: ignore[arg-type]


def test_the_command_line_is_vllms_with_fixed_lengths_and_no_key(tmp_path: Path) -> None:
    argv = bench.argv(_load(), tmp_path, "p")
    pairs = {flag: argv[i + 1] for i, flag in enumerate(argv[:-1]) if flag.startswith("--")}
    assert argv[1:3] == ["-m", "loadtest.gpu.bench"]
    assert pairs["--backend"] == "openai-chat" and pairs["--endpoint"] == "/v1/chat/completions"
    assert pairs["--random-input-len"] == "200" and pairs["--random-output-len"] == "128"
    assert "--ignore-eos" in argv and pairs["--max-concurrency"] == "64" and pairs["--seed"] == "7"
    assert "--request-rate" not in argv and "--goodput" not in argv and "--header" not in argv
    responses = bench.argv(_load(api="responses", concurrency=None, rate=450.0, goodput_ttft_ms=1000), tmp_path, "r")
    assert responses[responses.index("--endpoint") + 1] == "/v1/responses"
    assert responses[responses.index("--request-rate") + 1] == "450.000" and "--max-concurrency" not in responses
    assert responses[responses.index("--goodput") + 1] == "ttft:1000"


def test_a_saved_result_is_summarised_with_errors_counted_by_reason(tmp_path: Path) -> None:
    result = {
        "completed": 7, "failed": 3, "duration": 2.5, "total_output_tokens": 896, "output_throughput": 358.4,
        "request_goodput": 2.0, "p50_ttft_ms": 12.0, "p99_ttft_ms": 40.0, "p50_itl_ms": 3.0, "p99_itl_ms": 9.0,
        "errors": ["", "Too Many Requests", "Too Many Requests", "Service Unavailable", "", "", "", "", "", ""],
    }  # fmt: skip
    (tmp_path / "r.json").write_text(json.dumps(result))
    summary = bench.summarise(tmp_path / "r.json")
    assert summary["errors"] == {"Too Many Requests": 2, "Service Unavailable": 1}
    assert summary["output_tokens_per_s"] == 358.4 and summary["ttft_p99_ms"] == 40.0
    assert bench.summarise(tmp_path / "missing.json") == {"completed": None}


def test_finish_reads_each_clients_own_cpu_and_time_boxes_it(tmp_path: Path) -> None:
    # The busy client has burnt its CPU second and is exiting before the wait begins, the sleeper would sleep far
    # past the time box: which one ends by itself and which one is killed does not depend on the machine's speed.
    busy = "import time\nend = time.process_time() + 1.0\nwhile time.process_time() < end: pass\nprint('burnt')"
    clients = []
    for name, code in (("busy", busy), ("sleeper", "import time; time.sleep(600)")):
        output = subprocess.PIPE if name == "busy" else None
        process = subprocess.Popen([sys.executable, "-c", code], stdout=output, text=True)
        clients.append(bench.Client(name, _load(), process, tmp_path / f"{name}.json", tmp_path / f"{name}.log"))
    burnt = clients[0].process.stdout
    assert burnt is not None
    with burnt:
        assert burnt.read() == "burnt\n"  # to its end: the busy client has closed its output
    busy_result, sleeper_result = bench.finish(clients, timeout_s=15.0)
    # Its own CPU from wait4 (no result file: no benchmark duration to take a share over): the busy client's
    # second, and the sleeper's start-up alone, not the busy client's second as well.
    assert busy_result["client"]["cpu_s"] >= 1.0 and busy_result["client"]["run_cpu_share"] is None
    assert busy_result["returncode"] == 0 and not busy_result["timed_out"]
    assert sleeper_result["timed_out"] and sleeper_result["client"]["cpu_s"] < busy_result["client"]["cpu_s"]
    assert sleeper_result["completed"] is None


def test_the_run_share_is_taken_over_the_benchmarks_own_seconds_not_its_start() -> None:
    # 10 s of start-up at a full core, then 4 s of benchmark at a quarter core (samples every 0.5 s).
    samples = [(t / 2, min(t / 2, 10.0) + max(t / 2 - 10.0, 0.0) * 0.25) for t in range(29)]
    assert bench.run_share(samples, 4.0) == 0.25
    assert bench.run_share(samples[:1], 4.0) is None and bench.run_share(samples, 0.0) is None


RESPONSES_EVENTS = [
    {"type": "response.created", "response": {"id": "r"}},
    {"type": "response.output_text.delta", "delta": "Hel"},
    {"type": "response.output_text.delta", "delta": "lo"},
    {"type": "response.output_text.delta", "delta": "!"},
    {"type": "response.completed", "response": {"usage": {"input_tokens": 5, "output_tokens": 3}}},
]


async def _serve_and_ask(events: list[dict[str, object]]) -> tuple[object, list[dict[str, object]]]:
    """A real HTTP server streaming these Responses events, asked once by the backend."""
    from vllm.benchmarks.lib.endpoint_request_func import RequestFuncInput

    from loadtest.gpu.responses_client import request_openai_responses

    seen: list[dict[str, object]] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        seen.append({"body": await request.json(), "auth": request.headers.get("Authorization")})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event in events:
            await response.write(f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode())
            await asyncio.sleep(0.01)
        return response

    app = web.Application()
    app.router.add_post("/v1/responses", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        async with aiohttp.ClientSession() as session:
            request = RequestFuncInput(
                prompt="hi", api_url=f"http://127.0.0.1:{port}/v1/responses", prompt_len=1, output_len=3,
                model="/m", model_name="nemotron", ignore_eos=True,
            )  # fmt: skip
            output = await request_openai_responses(request, session)
    finally:
        await runner.cleanup()
    return output, seen


@pytest.mark.parametrize("events", [RESPONSES_EVENTS, RESPONSES_EVENTS[:-1]], ids=["complete", "no-terminal"])
def test_the_responses_backend_times_text_deltas(
    events: list[dict[str, object]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    output, seen = asyncio.run(_serve_and_ask(events))
    body = seen[0]["body"]
    assert isinstance(body, dict)
    assert body["input"] == "hi" and body["max_output_tokens"] == 3 and body["stream"] and body["ignore_eos"]
    assert body["model"] == "nemotron" and seen[0]["auth"] == "Bearer sk-test"
    if len(events) == len(RESPONSES_EVENTS):
        assert output.success and output.generated_text == "Hello!" and output.output_tokens == 3  # type: ignore[attr-defined]
        assert output.ttft > 0 and len(output.itl) == 2  # type: ignore[attr-defined]
    else:
        assert not output.success and "terminal event" in output.error  # type: ignore[attr-defined]
