"""The load tool's pieces on their own: how a point's flags become vLLM's client's command line, how its saved
result becomes a point's figures, the prompts file check, metrics parsing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loadtest.cli import check_prompts_file
from loadtest.cpusplit import parse_perf_dso, parse_strace_counts
from loadtest.gpu import bench
from loadtest.overhead import parse_options
from loadtest.phases import PhaseRecord, chunk_cost_ratio, chunk_cost_us
from loadtest.phases import Workload as PhaseWorkload
from loadtest.points import Shape, Workload, error_reason, request_rows, summary
from loadtest.processes import cpu_seconds, run_seconds, tree_sum
from loadtest.telemetry import Snapshot, metrics_delta, parse_metrics, server_side

pytestmark = pytest.mark.timeout(30)


def _flags(load: bench.Load) -> dict[str, list[str]]:
    """Each flag of the command line with the values after it."""
    flags: dict[str, list[str]] = {}
    current: list[str] = []
    for arg in bench.argv(load, Path("/results"), "p")[3:]:
        if arg.startswith("--"):
            current = flags.setdefault(arg, [])
        else:
            current.append(arg)
    return flags


def test_a_closed_loop_is_vllms_max_concurrency_at_an_unbounded_rate() -> None:
    workload = Workload(model="m", tokenizer="/tok", endpoint="completions", requests=40, warmup=2, seed=3)
    flags = _flags(workload.load("http://h:1", Shape(concurrency=8), seed=4))
    assert flags["--max-concurrency"] == ["8"] and "--request-rate" not in flags  # vLLM's default: inf
    assert flags["--backend"] == ["openai"] and flags["--endpoint"] == ["/v1/completions"]
    assert flags["--num-prompts"] == ["40"] and flags["--num-warmups"] == ["2"] and flags["--seed"] == ["4"]
    assert flags["--percentile-metrics"] == ["ttft,tpot,itl,e2el,client_queue_time"]
    assert flags["--metric-percentiles"] == ["50,90,99"]
    assert "--ignore-eos" not in flags and "--goodput" not in flags and "--burstiness" not in flags
    assert flags["--dataset-name"] == ["random"] and flags["--random-range-ratio"] == ["0"]


def test_an_open_loop_is_a_rate_with_burstiness_and_arrivals_over_the_duration() -> None:
    workload = Workload(
        model="m", tokenizer="/tok", duration_s=30, burstiness=0.5, slo_ttft_ms=200, slo_e2el_ms=1500, ignore_eos=True
    )
    flags = _flags(workload.load("http://h:1", Shape(rate=2.5, max_concurrency=16), seed=0))
    assert flags["--request-rate"] == ["2.500"] and flags["--burstiness"] == ["0.5"]
    assert flags["--max-concurrency"] == ["16"] and flags["--num-prompts"] == ["75"]
    assert flags["--goodput"] == ["ttft:200", "e2el:1500"] and "--ignore-eos" in flags
    assert flags["--backend"] == ["openai-chat"] and flags["--endpoint"] == ["/v1/chat/completions"]
    assert "--max-concurrency" not in _flags(workload.load("http://h:1", Shape(rate=2.5), seed=0))
    assert Workload(model="m", tokenizer="t").num_prompts(Shape(concurrency=1)) == 100


def test_a_prompts_file_is_vllms_custom_dataset_sent_as_written(tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    own_lengths = Workload(model="m", tokenizer="/tok", prompts_file=prompts, output_len=None, temperature=0.7)
    flags = _flags(own_lengths.load("http://h:1", Shape(concurrency=1), seed=0))
    assert flags["--dataset-name"] == ["custom"] and flags["--dataset-path"] == [str(prompts)]
    assert flags["--custom-output-len"] == ["-1"], "each line's output_tokens"
    assert "--skip-chat-template" in flags and "--random-range-ratio" not in flags
    assert flags["--temperature"] == ["0.7"]
    prompts.write_text('{"prompt": "Say hi", "output_tokens": 3}\n\n{"prompt": "Hello"}\n')
    check_prompts_file(prompts, output_tokens_needed=False)
    with pytest.raises(ValueError, match=r"p.jsonl:3: needs \"output_tokens\""):
        check_prompts_file(prompts, output_tokens_needed=True)


def test_shapes() -> None:
    assert Shape(concurrency=4).label == "c=4" and Shape(rate=0.5).label == "rate=0.5/s"
    for bad in ({}, {"concurrency": 1, "rate": 1.0}):
        with pytest.raises(ValueError):
            Shape(**bad)  # type: ignore[arg-type]


TRACEBACK = """Traceback (most recent call last):
  File "/venv/vllm/benchmarks/lib/endpoint_request_func.py", line 230, in async_request_openai_completions
    async with session.post(url=api_url, json=payload, headers=headers) as response:
aiohttp.client_exceptions.ClientConnectorError: Cannot connect to host 127.0.0.1:9 ssl:default [Connection refused]
"""


def test_error_reasons() -> None:
    assert error_reason("Too Many Requests") == "Too Many Requests"
    assert error_reason(TRACEBACK).startswith("aiohttp.client_exceptions.ClientConnectorError: Cannot connect")


def _saved(tmp_path: Path, **fields: object) -> tuple[dict[str, object], dict[str, object]]:
    """A saved vLLM result with `fields`, and bench.summarise's figures of it."""
    (tmp_path / "r.json").write_text(json.dumps(fields))
    return fields, bench.summarise(tmp_path / "r.json")


def test_a_point_where_nothing_succeeded_has_no_figures(tmp_path: Path) -> None:
    # What vLLM saves then: zeros for every figure, the errors, each request's lists.
    saved, figures = _saved(
        tmp_path, completed=0, failed=2, duration=0.5, total_output_tokens=0, output_throughput=0.0,
        request_throughput=0.0, total_input_tokens=0, mean_ttft_ms=0.0, p50_ttft_ms=0.0, p90_ttft_ms=0.0,
        p99_ttft_ms=0.0, errors=[TRACEBACK, "Bad Gateway"], start_times=[10.0, 10.5], ttfts=[0.0, 0.0],
        latencies=[0.0, 0.0], input_lens=[16, 16], output_lens=[0, 0],
    )  # fmt: skip
    point = summary(saved, figures, Workload(model="m", tokenizer="t"))
    assert point["ttft_ms"] is None and point["e2el_ms"] is None
    assert point["errors"] == {TRACEBACK.strip().splitlines()[-1]: 1, "Bad Gateway": 1}
    assert point["goodput"] == {"slo_ttft_ms": None, "slo_e2el_ms": None, "requests": None, "fraction": None,
                                "per_s": None}  # fmt: skip
    rows = request_rows(saved)
    assert [r["start_s"] for r in rows] == [0.0, 0.5] and all(r["latency_ms"] is None for r in rows)
    assert rows[1]["error"] == "Bad Gateway"


def test_figures_are_vllms_and_goodput_its_rate_over_the_duration(tmp_path: Path) -> None:
    figures_ms = {f"{stat}_{metric}_ms": value for metric in ("ttft", "tpot", "itl", "e2el")
                  for stat, value in (("mean", 5.0), ("p50", 4.0), ("p90", 8.0), ("p99", 9.0))}  # fmt: skip
    saved, figures = _saved(
        tmp_path, completed=8, failed=2, duration=2.0, request_goodput=3.0, total_output_tokens=80,
        output_throughput=40.0, request_throughput=4.0, total_input_tokens=160, errors=[""] * 8 + ["x", "x"],
        **figures_ms,
    )  # fmt: skip
    point = summary(saved, figures, Workload(model="m", tokenizer="t", slo_ttft_ms=6.0))
    assert point["ttft_ms"] == {"mean": 5.0, "p50": 4.0, "p90": 8.0, "p99": 9.0}
    assert point["client_queue_time_ms"] is None, "vLLM reports it under a cap only"
    assert point["goodput"]["requests"] == 6 and point["goodput"]["fraction"] == 0.6
    assert (point["output_tokens_per_s"], point["errors"]) == (40.0, {"x": 2})


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


def test_overhead_takes_settings_for_the_measured_gateway_and_names_them() -> None:
    options, _ = parse_options(["--setting", "NEMOTRON_LIMITS__OVERLAP_ADMISSION=true", "--setting", "NEMOTRON_X=a=b"])
    assert options.settings == (("NEMOTRON_LIMITS__OVERLAP_ADMISSION", "true"), ("NEMOTRON_X", "a=b"))
    assert options.label.endswith(", NEMOTRON_LIMITS__OVERLAP_ADMISSION=true, NEMOTRON_X=a=b")
    for bad in ("LOG_LEVEL=debug", "NEMOTRON_LOG_LEVEL"):
        with pytest.raises(SystemExit):
            parse_options(["--setting", bad])


PERF_REPORT = """# Total Lost Samples: 0
#
# Samples: 2K of event 'cpu-clock:pppH'
# Event count (approx.): 1032000000
#
# Overhead  Shared Object
# ........  ..............................................
#
    47.82%  libpython3.11.so.1.0
    39.83%  [kernel.kallsyms]
     4.84%  loop.cpython-311-x86_64-linux-gnu.so
"""

STRACE_SUMMARY = """% time     seconds  usecs/call     calls    errors syscall
------ ----------- ----------- --------- --------- ----------------
 64.21    0.428413          15     28447           write
 14.44    0.096375          15      6366           read
  0.01    0.000018          18         1         1 connect
------ ----------- ----------- --------- --------- ----------------
100.00    0.667197          14     34814         1 total
"""


def test_the_cpu_split_reads_perfs_shares_as_seconds_and_straces_calls() -> None:
    split = parse_perf_dso(PERF_REPORT)
    assert split.seconds == pytest.approx(1.032)
    assert split.by_object["[kernel.kallsyms]"] == pytest.approx(0.3983 * 1.032)
    assert split.by_object["libpython3.11.so.1.0"] == pytest.approx(0.4782 * 1.032)
    assert len(split.by_object) == 3
    assert parse_strace_counts(STRACE_SUMMARY) == {"write": 28447, "read": 6366, "connect": 1}
    with pytest.raises(ValueError):
        parse_perf_dso("no samples")


def _stream_record(round_: int, target: str, chunks: int, us_per_chunk: float) -> PhaseRecord:
    ms_per_request = 0.5 + chunks * us_per_chunk / 1000
    return PhaseRecord(
        round=round_,
        workload=f"stream {chunks} chunks c=64",
        target=target,
        concurrency=64,
        stream=True,
        chunks=chunks,
        requests=100,
        errors=0,
        first_error=None,
        wall_s=1.0,
        rps=100.0,
        p50_ms=1.0,
        p99_ms=1.0,
        first_byte_p50_ms=1.0,
        reads_per_request=1.0,
        cpu_s={target: 100 * ms_per_request / 1000},
        sys_s={target: 0.0},
        wait_s={target: 0.0},
    )


def test_the_per_chunk_ratio_pairs_each_round_with_the_reference_measured_beside_it() -> None:
    streams = (
        PhaseWorkload("stream 16 chunks c=64", 64, True, 16),
        PhaseWorkload("stream 64 chunks c=64", 64, True, 64),
    )
    # The machine drifts between rounds (x1, x1.5, x2); the gateway costs 1.3x nginx in each round but one, where
    # nginx's phase was disturbed; round 3's nginx slope is 0 (noise), so that round cannot be a ratio.
    gateway = [13.0, 19.5, 26.0, 13.0]
    nginx = [10.0, 30.0, 20.0, 0.0]
    records = [
        _stream_record(k, target, chunks, costs[k])
        for k in range(4)
        for target, costs in (("gateway", gateway), ("nginx", nginx))
        for chunks in (16, 64)
    ]
    assert chunk_cost_us(records, "gateway", streams) == pytest.approx(16.25)
    assert chunk_cost_ratio(records, "gateway", "nginx", streams) == pytest.approx(1.3)
    # The ratio of the medians mixes rounds: 16.25 / 15.0.
    assert chunk_cost_us(records, "gateway", streams) / chunk_cost_us(records, "nginx", streams) == pytest.approx(
        16.25 / 15.0
    )


def test_a_processs_cpu_is_counted_to_the_microsecond_over_all_its_threads() -> None:
    # Two threads burn CPU, then the process waits to be read: the scheduler's count agrees with the ticks of
    # /proc/<pid>/stat, which are 10 ms each, and has no such steps.
    burn = (
        "import sys, threading, time\n"
        "def spin():\n"
        "    end = time.thread_time() + 0.3\n"
        "    while time.thread_time() < end: pass\n"
        "threads = [threading.Thread(target=spin) for _ in range(2)]\n"
        "[t.start() for t in threads]; [t.join() for t in threads]\n"
        "print('done', flush=True); sys.stdin.read()\n"
    )
    spawned = time.monotonic()
    with subprocess.Popen(
        [sys.executable, "-c", burn], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as child:
        try:
            assert child.stdout is not None and child.stdout.readline() == "done\n"
            ran = run_seconds(child.pid)
            user, system = cpu_seconds(child.pid)
            # The two threads ended: their 0.6 s stay in the process's total, which is no more than every core of
            # the machine could have run over the process's life so far.
            most = (time.monotonic() - spawned) * (os.cpu_count() or 1)
            assert 0.6 <= ran <= most
            assert 0.6 - 0.01 <= user + system <= most  # ticks of 10 ms, rounded down
            assert abs(ran * 100 - round(ran * 100)) > 1e-6, "nanoseconds, not 10 ms ticks"
            assert tree_sum(child.pid, run_seconds) == pytest.approx(ran, abs=0.01)
        finally:
            child.kill()
