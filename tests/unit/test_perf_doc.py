"""The performance page's tables are the newest run summaries, rendered; a summary keeps what its table needs."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest import summary
from tools import perf_doc


def test_the_performance_page_is_current() -> None:
    page = perf_doc.PAGE.read_text()
    assert perf_doc.render_page(page, summary.load_all()) == page, (
        f"{perf_doc.PAGE.relative_to(perf_doc.ROOT)} differs from loadtest/summaries/: "
        f"run `.venv/bin/python -m tools.perf_doc` and commit the page"
    )


def test_every_benchmark_has_a_table_and_a_summary_naming_its_run() -> None:
    page = perf_doc.PAGE.read_text()
    kept = summary.load_all()
    for benchmark in summary.BENCHMARKS:
        assert perf_doc.begin(benchmark) in page
        kept_one = any(entry["benchmark"] == benchmark for entry in kept)
        if benchmark in summary.FIRST_RUN_PENDING:
            assert not kept_one, f"{benchmark} has a summary now: drop it from loadtest.summary.FIRST_RUN_PENDING"
        else:
            assert kept_one
    for entry in kept:
        assert entry["benchmark"] in summary.BENCHMARKS
        assert entry["commit"] and entry["date"][:4].isdigit() and entry["command"]
        assert summary.path_of(entry).is_file()


def _point(target: str, c: int, tokens: float, ttft: float) -> dict[str, object]:
    return {
        "target": target,
        "api": "chat",
        "concurrency": c,
        "clients": 1,
        "check": False,
        "cut": False,
        "requests": 10,
        "ok": 10,
        "output_tokens_per_s": tokens,
        "ttft_p50_ms": ttft,
        "itl_p50_ms": 3.0,
        "cpu_s_per_1k_tokens": {"gateway": 0.05, "vllm-api": 0.25},
    }


def test_a_sweep_pairs_each_concurrency_in_run_order(tmp_path: Path) -> None:
    points = [
        _point("direct", 16, 1000.0, 50.0),
        _point("gateway", 16, 990.0, 51.0),
        _point("gateway", 16, 1010.0, 49.0),
        _point("direct", 16, 1000.0, 50.0),
        {**_point("gateway", 64, 0.0, 0.0), "cut": True, "ok": 0},
    ]
    entry = summary.summary("gpu-sweep", "abc1234", "2030-01-02", "loadtest/gpu/run bench", "a GPU", {"points": points})
    table = perf_doc.render(entry)
    assert "Run at `abc1234`, 2030-01-02" in table and "`loadtest/gpu/run bench`" in table
    assert "99.0 % (direct first), 101.0 % (gateway first); mean **100.0 %**" in table
    assert "+1.00, -1.00 ms" in table and "0 of 40" in table
    assert "| 64 |" not in table  # a point the time box cut is no pairing


def test_the_newest_summary_is_the_one_shown() -> None:
    old = summary.summary("soak", "aaaaaaa", "2030-01-01", "make soak", "", _soak(1))
    new = summary.summary("soak", "bbbbbbb", "2030-01-02", "make soak", "", _soak(2))
    page = f"{perf_doc.begin('soak')}\n{perf_doc.END}\n"
    rendered = perf_doc.render_page(page, [old, new])
    assert "`bbbbbbb`" in rendered and "`aaaaaaa`" not in rendered
    with pytest.raises(ValueError, match="no summary of soak"):
        perf_doc.render_page(page, [])


def _soak(requests: int) -> dict[str, object]:
    return {
        "requests": requests,
        "streams": 0,
        "abandoned": 0,
        "errors": 0,
        "rss_mb": [1.0, 1.0],
        "rss_growth_mb": 0.0,
        "fds": [1, 1],
        "fd_growth": 0,
        "passed": True,
    }


def test_an_overhead_report_becomes_the_tables_row() -> None:
    entry = {"gateway_cpu_ms_per_request": 0.6, "gateway_run_queue_wait": 0.01}
    report = {
        "revision": "abc1234",
        "options": {"lean": False},
        "summary": {
            "non-stream c=1": entry,
            "non-stream c=32": {**entry, "gateway_cpu_ms_per_request": 0.3, "gateway_run_queue_wait": 0.02},
            "targets": {
                "gateway_cpu_ms_per_request": [0.3, 1.0, True],
                "gateway_rps_saturation": [3300.0, 1500.0, True],
                "added_p50_ms_c1": [0.9, 1.0, True],
                "gateway_cpu_us_per_chunk_slope": [11.0, 25.0, True],
                "nginx_cpu_us_per_chunk_slope": [8.0, None, None],
                "gateway_vs_nginx_per_chunk": [1.3, 1.5, True],
                "gateway_vs_nginx_per_chunk_of_medians": [1.4, None, None],
            },
        },
    }
    config = summary.overhead_config("default settings", report)
    assert config["cpu_ms_per_request_c1"] == 0.6 and config["waited_for_cpu"] == 0.02
    table = perf_doc.render(
        summary.summary("overhead", "abc1234", "2030-01-01", "make bench", "", {"configs": [config]})
    )
    assert "| default settings | 0.300 | 3,300 | 0.600 (0.900) | 11.0 (8.0; 1.30\u00d7) | 2 % |" in table


def test_the_apis_table_sets_each_apis_gateway_point_beside_its_direct_one() -> None:
    points = [
        _point("direct", 64, 1000.0, 50.0),
        _point("gateway", 64, 1030.0, 49.0),
        {**_point("direct", 64, 800.0, 60.0), "api": "responses", "ttft_p99_ms": 90.0},
        {**_point("gateway", 64, 760.0, 61.0), "api": "responses", "ttft_p99_ms": 80.0, "ok": 9},
    ]
    points[0]["ttft_p99_ms"] = points[1]["ttft_p99_ms"] = 70.0
    entry = summary.summary("gpu-apis", "abc1234", "2030-01-02", "run bench", "a GPU", {"points": points})
    rows = [
        line
        for line in perf_doc.render(entry).splitlines()
        if line.startswith("| chat") or line.startswith("| responses")
    ]
    assert rows[0].startswith("| chat | 64 | 1,000 / 1,030 (**103.0 %**)")
    assert rows[1].startswith("| responses | 64 | 800 / 760 (**95.0 %**) | 60.0 / 90.0 | 61.0 / 80.0")
    assert rows[1].endswith("| 1 of 20 |")


def test_a_benchmark_awaiting_its_first_run_keeps_its_markers_and_nothing_else(monkeypatch: pytest.MonkeyPatch) -> None:
    page = f"before\n{perf_doc.begin('gpu-pool')}\n\nstale\n\n{perf_doc.END}\nafter\n"
    with pytest.raises(ValueError, match="no summary of gpu-pool"):
        perf_doc.render_page(page, [])  # a table without a run is an error, unless it awaits its first
    monkeypatch.setattr(perf_doc, "FIRST_RUN_PENDING", frozenset({"gpu-pool"}))
    assert perf_doc.render_page(page, []) == f"before\n{perf_doc.begin('gpu-pool')}\n{perf_doc.END}\nafter\n"


def _pool_phase(target: str, round_: int, hit: float, p50: float, spread: tuple[int, int]) -> dict[str, object]:
    replicas = {"http://a": {"requests": spread[0]}, "http://b": {"requests": spread[1]}}
    return {
        "name": f"{target}-r{round_}", "target": target, "round": round_, "requests": 196, "completed": 196,
        "failed": 0, "errors": {}, "cut": False, "hit_rate": hit, "ttft_p50_ms": p50, "ttft_p99_ms": 2 * p50,
        "output_tokens_per_s": 5000.0, "replicas": replicas,
    }  # fmt: skip


def test_a_pool_run_shows_each_targets_rounds_and_the_failover() -> None:
    phases = [
        {"name": "warm-up", "target": "replicas", "completed": 64, "failed": 0, "wall_s": 9.0},
        _pool_phase("single", 1, 0.70, 100.0, (196, 0)),
        _pool_phase("affinity", 1, 0.68, 50.0, (100, 96)),
        _pool_phase("round_robin", 1, 0.40, 100.0, (98, 98)),
        _pool_phase("round_robin", 2, 0.42, 120.0, (98, 98)),
        _pool_phase("affinity", 2, 0.70, 60.0, (97, 99)),
        _pool_phase("single", 2, 0.70, 110.0, (196, 0)),
        {
            **_pool_phase("affinity", 0, 0.0, 55.0, (150, 20)), "name": "failover", "failed": 3, "hit_rate": None,
            "kill": {
                "finished_there_before": 29.0, "gateway_in_flight": 5, "engine_running_waiting": 6.0,
                "gateway_cut_mid_stream": 2.0, "gateway_failed_over": 4.0,
            },
        },
    ]  # fmt: skip
    report = {"label": "l", "workload": {"conversations": 49}, "phases": phases, "notes": []}
    data = summary.pool_phases(report)
    assert data["phases"][0]["name"] == "single-r1" and len(data["phases"]) == 6
    table = perf_doc.render(summary.summary("gpu-pool", "abc1234", "2030-01-03", "run pool", "an H100", data))
    assert "| one replica alone (the reference) | 70.0 %, 70.0 % | 100.0 / 200.0, 110.0 / 220.0 | \u2013 |" in table
    assert (
        "| two replicas, affinity | 68.0 %, 70.0 % (**98.6 %**) | 50.0 / 100.0, 60.0 / 120.0 | **0.50\u00d7** |"
        in table
    )
    assert "| 100 / 96; 97 / 99 | 0 of 392 |" in table
    # vLLM's client counts a stream cut after its first chunk as a success: the gateway's cut streams are added.
    assert "**5 of 196** requests failed (3 by vLLM's client" in table
    assert "2 streams the gateway ended with the error event); 4 refused by the dead replica" in table
    assert "in flight there at the kill: 5 by the gateway's `/ready`" in table
    assert table.rstrip().endswith("goal (no failure beyond those in flight): met.")
    del phases[-1]["kill"]["gateway_cut_mid_stream"]  # type: ignore[attr-defined]
    table = perf_doc.render(
        summary.summary("gpu-pool", "abc1234", "2030-01-03", "run pool", "an H100", summary.pool_phases(report))
    )
    assert table.rstrip().endswith("not judged (the gateway's in-flight count or its cut streams were not read).")
