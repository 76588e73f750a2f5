"""The pool step's workload and its own reading of what it measured: conversations whose turns repeat the earlier
ones, sent turn by turn; hit rates from the replicas' counters; the clients a phase routes to; the goals judged."""

from __future__ import annotations

import argparse
import itertools
import json
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from loadtest import conversations
from loadtest.gpu import pool
from tests.loadtest.conftest import threaded_http_server

pytestmark = pytest.mark.timeout(30)


def _lines(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_turn_repeats_its_conversations_earlier_turns_and_goes_after_them(tmp_path: Path) -> None:
    shape = conversations.Shape(conversations=5, turns=3, prefix_tokens=120, turn_tokens=20, max_prompt_tokens=400)
    held = conversations.write(tmp_path / "c.jsonl", shape, seed=7)
    lines = _lines(tmp_path / "c.jsonl")
    assert held["requests"] == len(lines) == 15
    assert [(line["turn"], line["conversation"]) for line in lines] == [(t, c) for t in range(3) for c in range(5)]
    by_conversation: dict[object, list[str]] = {}
    for line in lines:
        by_conversation.setdefault(line["conversation"], []).append(str(line["prompt"]))
    for turns in by_conversation.values():
        assert all(later.startswith(earlier + "\n") for earlier, later in itertools.pairwise(turns))
    firsts = [turns[0][:40] for turns in by_conversation.values()]
    assert len(set(firsts)) == 5  # each conversation's leading characters are its own
    again = conversations.write(tmp_path / "d.jsonl", shape, seed=8)
    assert again["requests"] == 15 and _lines(tmp_path / "d.jsonl")[0]["prompt"] != lines[0]["prompt"]


def test_a_shape_past_its_bounds_is_refused() -> None:
    with pytest.raises(ValueError, match="conversations must be"):
        conversations.Shape(conversations=0, turns=2)
    with pytest.raises(ValueError, match="turns must be"):
        conversations.Shape(conversations=2, turns=conversations.MAX_TURNS + 1)
    with pytest.raises(ValueError, match="max-prompt-tokens"):
        conversations.Shape(conversations=2, turns=10, prefix_tokens=3000, turn_tokens=200, max_prompt_tokens=3900)


def test_the_hit_rate_is_summed_over_the_replicas_that_answered() -> None:
    before: dict[str, dict[str, float] | None] = {
        "a": {pool._HITS: 100.0, pool._QUERIES: 200.0, pool._SUCCESS: 1.0},
        "b": {pool._HITS: 0.0, pool._QUERIES: 0.0, pool._SUCCESS: 0.0},
        "c": None,
    }
    after: dict[str, dict[str, float] | None] = {
        "a": {pool._HITS: 400.0, pool._QUERIES: 600.0, pool._SUCCESS: 11.0},
        "b": {pool._HITS: 100.0, pool._QUERIES: 400.0, pool._SUCCESS: 10.0},
        "c": {pool._HITS: 5.0, pool._QUERIES: 5.0, pool._SUCCESS: 5.0},
    }
    deltas = pool.replica_deltas(before, after)
    assert deltas["a"] == {"queries": 400.0, "hits": 300.0, "requests": 10.0} and deltas["c"] is None
    assert pool.hit_rate(deltas) == pytest.approx(400 / 800)
    assert pool.hit_rate({"a": None}) is None


def test_the_figures_cover_every_client_of_a_phase(tmp_path: Path) -> None:
    first = {
        "completed": 2,
        "total_output_tokens": 20,
        "duration": 2.0,
        "ttfts": [0.1, 0.3, 0.0],
        "errors": ["", "", "reset"],
    }
    second = {"completed": 1, "total_output_tokens": 10, "duration": 3.0, "ttfts": [0.2], "errors": [""]}
    (tmp_path / "a.json").write_text(json.dumps(first))
    (tmp_path / "b.json").write_text(json.dumps(second))
    figures = pool.request_figures([tmp_path / "a.json", tmp_path / "b.json", tmp_path / "missing.json"])
    assert figures["completed"] == 3 and figures["failed"] == 1 and figures["errors"] == {"reset": 1}
    assert figures["ttft_p50_ms"] == pytest.approx(200.0) and figures["ttft_p99_ms"] == pytest.approx(298.0)
    assert figures["output_tokens_per_s"] == 10.0


def _args(tmp_path: Path, route: str) -> argparse.Namespace:
    return argparse.Namespace(
        route=route, replica=["http://r1", "http://r2"], work=tmp_path, concurrency=4,
        gateways={"single": "http://g-single", "affinity": "http://g-aff", "round_robin": "http://g-rr"},
    )  # fmt: skip


def test_a_phase_goes_to_its_gateway_or_the_client_routes_it(tmp_path: Path) -> None:
    lines = [{"prompt": f"p{t}-{c}", "conversation": c, "turn": t} for t in range(2) for c in range(3)]
    step = pool.Step.__new__(pool.Step)
    step.args = _args(tmp_path, "gateway")
    assert [(u, c, n) for u, _, c, n in pool._clients(step, "round_robin", lines, "x")] == [("http://g-rr", 4, 6)]
    step.args = _args(tmp_path, "client")
    affinity = pool._clients(step, "affinity", lines, "aff")
    assert [(u, c, n) for u, _, c, n in affinity] == [("http://r1", 2, 4), ("http://r2", 2, 2)]
    assert {line["conversation"] for line in _lines(affinity[1][1])} == {1}
    rr = pool._clients(step, "round_robin", lines, "rr")
    assert [n for _, _, _, n in rr] == [3, 3]
    assert [(u, n) for u, _, _, n in pool._clients(step, "single", lines, "one")] == [("http://r1", 6)]


def _phase(target: str, hit: float, ttft: float, **extra: object) -> dict[str, object]:
    return {"name": target, "target": target, "hit_rate": hit, "ttft_p50_ms": ttft, "cut": False, **extra}


def test_the_goals_are_judged_on_the_medians_and_the_kill() -> None:
    phases = [
        _phase("single", 0.70, 100.0),
        _phase("affinity", 0.66, 60.0),
        _phase("round_robin", 0.40, 100.0),
        _phase("single", 0.72, 100.0),
        _phase("affinity", 0.64, 80.0),
        _phase("round_robin", 0.42, 100.0),
    ]
    kill = {"gateway_in_flight": 3, "engine_running_waiting": 4.0, "gateway_cut_mid_stream": 2.0}
    failover = {**_phase("affinity", 0.0, 0.0), "name": "failover", "failed": 2, "requests": 196, "kill": kill}
    found = pool.verdicts([*phases, failover])
    assert (
        found[0].startswith("hit rate: affinity 65.0 % = 91.5 % of the single replica's 71.0 %") and "met" in found[0]
    )
    assert "0.70x round robin's 100.0 ms" in found[1] and found[1].endswith(": met")
    # vLLM's client counts a stream cut after its first chunk as a success: the gateway's cuts are failures too.
    assert found[2].startswith("failover: 4 of 196 failed (2 of them streams the gateway cut)")
    assert found[2].endswith("NOT met")
    kill.update(gateway_cut_mid_stream=1.0, gateway_failed_over=5.0)
    assert pool.verdicts([failover])[0] == (
        "failover: 3 of 196 failed (1 of them streams the gateway cut; 5 failed over before their first byte and "
        "served); at the kill 3 in flight there (vLLM's running + waiting: 4.0): met"
    )
    del kill["gateway_cut_mid_stream"]
    assert pool.verdicts([failover])[0].endswith("unjudged"), "a client's count alone cannot judge it"


def test_the_gateways_cuts_on_the_killed_replica_and_its_failovers_are_read_from_its_metrics() -> None:
    text = "\n".join(
        [
            "# TYPE nemotron_gateway_engine_errors_total counter",
            'nemotron_gateway_engine_errors_total{kind="refused",replica="http://127.0.0.1:8002"} 4.0',
            'nemotron_gateway_engine_errors_total{kind="mid_stream",replica="http://127.0.0.1:8002"} 6.0',
            'nemotron_gateway_engine_errors_total{kind="mid_stream",replica="http://127.0.0.1:8001"} 1.0',
            'nemotron_gateway_engine_errors_total{kind="frozen",replica="http://127.0.0.1:8002"} 1.0',
            'nemotron_gateway_routed_total{how="affinity",model="nemotron"} 586.0',
            'nemotron_gateway_routed_total{how="failover",model="nemotron"} 5.0',
        ]
    )
    with threaded_http_server(_answering(text.encode())) as url:
        found = pool.gateway_outcomes(url, "http://127.0.0.1:8002/")
    assert found == {"cut": 7.0, "failed_over": 5.0}
    assert pool.gateway_outcomes("http://127.0.0.1:9", "http://127.0.0.1:8002") is None, "nothing answers there"


def _answering(body: bytes) -> type[BaseHTTPRequestHandler]:
    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    return Metrics
