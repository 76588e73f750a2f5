"""The pool step on the GPU: two vLLM replicas, prefix-cache affinity against round robin, and failover.

Every load is `vllm bench serve` (loadtest/gpu/bench.py) on a prompts file of multi-turn conversations that share
long prefixes (loadtest/conversations.py: each conversation a document of its own, every turn repeating the earlier
ones, sent turn by turn in file order with `--disable-shuffle`). Each phase writes a file of its own seed, so no
phase finds its prompts cached by an earlier one. Phases, each written to pool.json / pool.md as it ends:

1. `warm-up`: random prompts straight to every replica at once (CUDA graphs, allocator), not measured.
2. For each round, in alternating order (the second round reversed), one phase per target:
   `single` (a gateway in front of the first replica alone: the reference hit rate, every turn where its
   conversation's earlier turns were served), `affinity` and `round_robin` (a gateway in front of both replicas
   with that picker). Per phase: the prefix-cache hit rate (the replicas' `vllm:prefix_cache_hits_total` over
   `vllm:prefix_cache_queries_total`, deltas over the phase, summed over the replicas: tokens found cached over
   tokens asked for), each replica's share of the requests, TTFT p50/p99 and output tokens/s over the phase's
   requests, and errors by the reason vLLM's client recorded.
3. `failover`: the affinity gateway again, and once the last replica has finished `--kill-after` of its share of
   the phase, its `vllm serve` process group is killed (SIGKILL). Just before, the gateway's /ready `replicas`
   entry of that replica (`in_flight`) and vLLM's own running + waiting requests there are read: the requests a
   kill may fail. Every other request must succeed (failover retries one the dead replica refused before its
   first byte). A stream cut after its first chunk is a failure that vLLM's client does not count (it marks a
   request successful once a chunk came, and skips the error event): the streams the affinity gateway ended with
   the error event on the killed replica, and the requests it failed over, are read from its /metrics
   (`nemotron_gateway_engine_errors_total`, `nemotron_gateway_routed_total`) before and after the phase.

Goals (reported, not asserted): affinity's hit rate at least 90 % of the single replica's, affinity's TTFT p50 at
most 0.7x round robin's, and no failed request in the failover phase beyond those in flight on the killed replica.

`--route client` (a gateway without the pool, for dry runs): no gateway; the client routes, one client process
per replica, each with its share of the lines (`affinity`: conversation i to replica i mod R; `round_robin`: line j
to replica j mod R; `single`: all to the first) and its share of the concurrency. Imports nothing from `gateway`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadtest import conversations
from loadtest.gpu import bench

GOAL_HIT_SHARE = 0.90  # affinity's hit rate over the single replica's, at least
GOAL_TTFT_FACTOR = 0.7  # affinity's TTFT p50 over round robin's, at most
TARGETS = ("single", "affinity", "round_robin")

_HITS, _QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"
_SUCCESS, _RUNNING, _WAITING = "vllm:request_success_total", "vllm:num_requests_running", "vllm:num_requests_waiting"
_COUNTERS = (_HITS, _QUERIES, _SUCCESS, _RUNNING, _WAITING)
_NONE = "\u2013"  # an empty cell


def percentile(values: Sequence[float], p: float) -> float | None:
    """The p-th percentile, interpolated between the nearest ranks (numpy's default, as vLLM's client reports)."""
    if not values:
        return None
    ordered = [float(value) for value in sorted(values)]
    rank = (len(ordered) - 1) * p / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def scrape(replicas: Sequence[str]) -> dict[str, dict[str, float] | None]:
    """Each replica's counters now (None for one that does not answer)."""
    return {url: bench.metric_sums(url, _COUNTERS) for url in replicas}


def replica_deltas(
    before: dict[str, dict[str, float] | None], after: dict[str, dict[str, float] | None]
) -> dict[str, dict[str, float] | None]:
    """Per replica: prefix-cache tokens asked for and found, requests finished, over the phase."""
    out: dict[str, dict[str, float] | None] = {}
    for url, first in before.items():
        last = after.get(url)
        if first is None or last is None:
            out[url] = None
            continue
        out[url] = {
            "queries": last[_QUERIES] - first[_QUERIES],
            "hits": last[_HITS] - first[_HITS],
            "requests": last[_SUCCESS] - first[_SUCCESS],
        }
    return out


def hit_rate(replicas: dict[str, dict[str, float] | None]) -> float | None:
    """Tokens found cached over tokens asked for, summed over the replicas that answered."""
    read = [r for r in replicas.values() if r is not None]
    queries = sum(r["queries"] for r in read)
    return sum(r["hits"] for r in read) / queries if queries else None


def request_figures(results: Sequence[Path]) -> dict[str, Any]:
    """TTFT p50/p99, output tokens/s and errors over every request of a phase's clients (their saved results)."""
    ttfts: list[float] = []
    errors: Counter[str] = Counter()
    completed = output = 0
    duration = 0.0
    for path in results:
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        for ttft, error in zip(data.get("ttfts") or (), data.get("errors") or (), strict=False):
            if error:
                errors[str(error)[:120]] += 1
            elif ttft:
                ttfts.append(ttft * 1000)
        completed += data.get("completed") or 0
        output += data.get("total_output_tokens") or 0
        duration = max(duration, float(data.get("duration") or 0.0))
    p50, p99 = percentile(ttfts, 50), percentile(ttfts, 99)
    return {
        "completed": completed,
        "failed": sum(errors.values()),
        "errors": dict(errors),
        "ttft_p50_ms": None if p50 is None else round(p50, 2),
        "ttft_p99_ms": None if p99 is None else round(p99, 2),
        "output_tokens_per_s": round(output / duration, 1) if duration else None,
        "duration_s": round(duration, 2),
    }


def ready_replicas(gateway: str) -> list[dict[str, Any]] | None:
    """The gateway's /ready `replicas` entries (503 answers carry them too); None where it names none."""
    try:
        with urllib.request.urlopen(f"{gateway}/ready", timeout=5) as answer:
            body = json.loads(answer.read())
    except urllib.error.HTTPError as refused:
        body = json.loads(refused.read() or b"{}")
    except (OSError, ValueError):
        return None
    replicas = body.get("replicas") if isinstance(body, dict) else None
    return replicas if isinstance(replicas, list) else None


# The engine failures after a stream's first byte: the gateway ends the stream with the error event.
_CUT_KINDS = ('kind="mid_stream"', 'kind="frozen"')


def gateway_outcomes(gateway: str, victim: str) -> dict[str, float] | None:
    """From the gateway's /metrics: `cut`, its streams on `victim` that it ended with the error event after their
    first byte, and `failed_over`, its requests tried again on another replica; None when unreadable."""
    try:
        with urllib.request.urlopen(f"{gateway}/metrics", timeout=5) as answer:
            text = answer.read().decode()
    except OSError:
        return None
    found = {"cut": 0.0, "failed_over": 0.0}
    for line in text.splitlines():
        if line.startswith("nemotron_gateway_engine_errors_total{") and f'replica="{victim.rstrip("/")}"' in line:
            if any(kind in line for kind in _CUT_KINDS):
                found["cut"] += float(line.rsplit(" ", 1)[1])
        elif line.startswith("nemotron_gateway_routed_total{") and 'how="failover"' in line:
            found["failed_over"] += float(line.rsplit(" ", 1)[1])
    return found


def in_flight_of(gateway: str, url: str) -> int | None:
    """The gateway's in-flight requests on replica `url` (its /ready entry), None where it names none."""
    for replica in ready_replicas(gateway) or ():
        if str(replica.get("url", "")).rstrip("/") == url.rstrip("/"):
            value = replica.get("in_flight")
            return int(value) if isinstance(value, int | float) else None
    return None


class Step:
    """The step's options, its time box and its record."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.started = time.monotonic()
        self.phases: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self.longest = float(args.phase_estimate)

    def left(self) -> float:
        """Seconds left of the step's deadline."""
        return float(self.args.deadline) - (time.monotonic() - self.started)

    def shape(self) -> conversations.Shape:
        """The conversations of one phase."""
        a = self.args
        return conversations.Shape(a.conversations, a.turns, a.prefix_tokens, a.turn_tokens, a.max_prompt_tokens)

    def record(self, phase: dict[str, Any]) -> None:
        """Keep a phase and rewrite pool.json / pool.md."""
        self.phases.append(phase)
        self.longest = max(self.longest, phase.get("wall_s") or 0.0)
        sys.stdout.write(f"{_line(phase)}\n")
        sys.stdout.flush()
        write(self.args.out, self.report())

    def report(self) -> dict[str, Any]:
        """What pool.json holds."""
        a = self.args
        workload = {
            "conversations": a.conversations,
            "turns": a.turns,
            "prefix_tokens": a.prefix_tokens,
            "turn_tokens": a.turn_tokens,
            "output_tokens": a.output_tokens,
            "concurrency": a.concurrency,
            "rounds": a.rounds,
            "route": a.route,
        }
        phases, notes = self.phases, self.notes
        return {"label": a.label, "replicas": a.replica, "workload": workload, "phases": phases, "notes": notes}


def _clients(step: Step, target: str, lines: list[dict[str, Any]], name: str) -> list[tuple[str, Path, int, int]]:
    """(base URL, prompts file, concurrency, prompts) of each client process of a phase."""
    a, work = step.args, step.args.work
    if a.route == "gateway" or target == "single":
        url = a.gateways[target] if a.route == "gateway" else a.replica[0]
        shares = [(url, lines)]
    else:
        n = len(a.replica)

        def pick(j: int, line: dict[str, Any]) -> int:
            return int(line["conversation"]) % n if target == "affinity" else j % n

        shares = [(url, [ln for j, ln in enumerate(lines) if pick(j, ln) == k]) for k, url in enumerate(a.replica)]
    clients = []
    for k, (url, share) in enumerate(shares):
        path = work / f"{name}-{k}.jsonl"
        path.write_text("".join(json.dumps(line) + "\n" for line in share))
        clients.append((url, path, max(1, a.concurrency // len(shares)), len(share)))
    return clients


def phase(step: Step, target: str, round_: int, seed: int, kill: bool = False) -> dict[str, Any]:
    """One phase: the conversations of `seed` through `target`; with `kill`, the last replica killed mid-run."""
    a = step.args
    name = "failover" if kill else f"{target}-r{round_}"
    source = a.work / f"{name}.jsonl"
    held = conversations.write(source, step.shape(), seed, str(a.model))
    lines = [json.loads(line) for line in source.read_text().splitlines()]
    started = time.monotonic()
    before = scrape(a.replica)
    watched = a.gateways.get("affinity") if kill and a.route == "gateway" else None
    outcomes_before = gateway_outcomes(watched, a.replica[-1]) if watched else None
    running = []
    for k, (url, path, concurrency, prompts) in enumerate(_clients(step, target, lines, name)):
        load = bench.Load(
            base_url=url, tokenizer=str(a.model), concurrency=concurrency, prompts=prompts, input_len=0,
            output_len=a.output_tokens, seed=seed, prompts_file=path, shuffle=False, warmups=0,
        )  # fmt: skip
        key = a.api_key if a.route == "gateway" else None
        running.append(bench.start(load, a.work, f"{name}-{k}", key))
    killed = watch_and_kill(step, running, before) if kill else None
    timeout = max(10.0, step.left() - 5)
    clients = bench.finish(running, timeout)
    after = scrape(a.replica)
    replicas = replica_deltas(before, after)
    result: dict[str, Any] = {
        "name": name,
        "target": "affinity" if kill else target,
        "round": round_,
        "seed": seed,
        "requests": len(lines),
        "prompts": held,
        **request_figures([c.result for c in running]),
        "hit_rate": None if kill else _round(hit_rate(replicas)),
        "replicas": replicas,
        "cut": any(c["timed_out"] for c in clients),
        "client_exit": [c["returncode"] for c in clients],
        "wall_s": round(time.monotonic() - started, 1),
    }
    if killed is not None:
        outcomes_after = gateway_outcomes(watched, a.replica[-1]) if watched else None
        if outcomes_before is not None and outcomes_after is not None:
            killed["gateway_cut_mid_stream"] = outcomes_after["cut"] - outcomes_before["cut"]
            killed["gateway_failed_over"] = outcomes_after["failed_over"] - outcomes_before["failed_over"]
        result["kill"] = killed
    return result


def watch_and_kill(step: Step, running: list[bench.Client], before: dict[str, Any]) -> dict[str, Any]:
    """Once the last replica has finished `--kill-after` of its share of the phase (or at `--kill-timeout`), read
    what is in flight there and SIGKILL its process group."""
    a = step.args
    victim = a.replica[-1]
    share = step.shape().requests / len(a.replica)
    wanted = max(1, math.floor(share * a.kill_after))
    start = before.get(victim) or {}
    deadline = time.monotonic() + a.kill_timeout
    done = 0.0
    while time.monotonic() < deadline and any(bench.running(c) for c in running):
        now = bench.metric_sums(victim, _COUNTERS)
        done = (now or {}).get(_SUCCESS, 0.0) - start.get(_SUCCESS, 0.0)
        if done >= wanted:
            break
        time.sleep(0.2)
    gateway = a.gateways.get("affinity", "")
    gauges = bench.metric_sums(victim, _COUNTERS) or {}
    in_flight = in_flight_of(gateway, victim) if a.route == "gateway" else None
    engine_in_flight = gauges.get(_RUNNING, 0.0) + gauges.get(_WAITING, 0.0) if gauges else None
    with contextlib.suppress(ProcessLookupError):
        os.killpg(a.victim_pgid, signal.SIGKILL)
    killed_at = time.monotonic()
    time.sleep(2)
    seen = ready_replicas(gateway) if a.route == "gateway" else None
    return {
        "replica": victim,
        "finished_there_before": done,
        "gateway_in_flight": in_flight,
        "engine_running_waiting": engine_in_flight,
        "gateway_view_2s_after": [r for r in seen or () if str(r.get("url", "")).rstrip("/") == victim.rstrip("/")],
        "at_s": round(killed_at - step.started, 1),
    }


def warm_up(step: Step) -> dict[str, Any]:
    """Random prompts straight to every replica at once: not measured, not cached by any phase."""
    a = step.args
    running = []
    for k, url in enumerate(a.replica):
        load = bench.Load(
            base_url=url, tokenizer=str(a.model), concurrency=a.concurrency, prompts=2 * a.concurrency,
            input_len=256, output_len=a.output_tokens, seed=a.seed + 900 + k,
        )  # fmt: skip
        running.append(bench.start(load, a.work, f"warm-up-{k}", None))
    started = time.monotonic()
    clients = bench.finish(running, max(10.0, min(120.0, step.left() - 60)))
    return {
        "name": "warm-up",
        "target": "replicas",
        "completed": sum(c.get("completed") or 0 for c in clients),
        "failed": sum(c.get("failed") or 0 for c in clients),
        "wall_s": round(time.monotonic() - started, 1),
    }


def run(step: Step) -> None:
    """Warm-up, the rounds of measured phases in alternating order, then failover, within the deadline."""
    a = step.args
    step.record(warm_up(step))
    seed = a.seed
    reserve = 0.0
    for round_ in range(1, a.rounds + 1):
        order = TARGETS if round_ % 2 else tuple(reversed(TARGETS))
        for target in order:
            reserve = step.longest * 1.3 + 10 if a.failover else 0.0
            if step.left() - reserve < step.longest * 1.2:
                step.notes.append(f"{target} of round {round_} not run: {step.left():.0f} s left of the deadline")
                continue
            seed += 1
            step.record(phase(step, target, round_, seed))
    if a.failover:
        if a.route == "gateway" and ready_replicas(a.gateways["affinity"]) is None:
            step.notes.append("the affinity gateway's /ready names no replicas: no in-flight count to compare")
        if step.left() < step.longest:
            step.notes.append(f"failover not run: {step.left():.0f} s left of the deadline")
        else:
            step.record(phase(step, "affinity", 0, seed + 1, kill=True))
    write(a.out, step.report())


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def _pct(value: float | None) -> str:
    return _NONE if value is None else f"{value * 100:.1f} %"


def _ms(value: float | None) -> str:
    return _NONE if value is None else f"{value:,.1f}"


def _line(phase: dict[str, Any]) -> str:
    if phase["name"] == "warm-up":
        return f"| warm-up | {phase['completed']} ok, {phase['failed']} failed | {phase['wall_s']} s |"
    return (
        f"| {phase['name']} | hit rate {_pct(phase.get('hit_rate'))} | TTFT p50 {_ms(phase['ttft_p50_ms'])} / p99 "
        f"{_ms(phase['ttft_p99_ms'])} ms | {_ms(phase['output_tokens_per_s'])} tokens/s | {phase['completed']} ok, "
        f"{phase['failed']} failed | {phase['wall_s']} s |"
    )


def _median(values: list[float]) -> float | None:
    return percentile(values, 50)


def verdicts(phases: Sequence[dict[str, Any]]) -> list[str]:
    """The three goals, each with the figures it was judged on (medians over the rounds)."""
    by: dict[str, dict[str, list[float]]] = {t: {"hit": [], "ttft": []} for t in TARGETS}
    for p in phases:
        if p["name"] in ("warm-up", "failover") or p.get("cut"):
            continue
        if p.get("hit_rate") is not None:
            by[p["target"]]["hit"].append(p["hit_rate"])
        if p.get("ttft_p50_ms") is not None:
            by[p["target"]]["ttft"].append(p["ttft_p50_ms"])
    out = []
    single, affinity = _median(by["single"]["hit"]), _median(by["affinity"]["hit"])
    if single and affinity is not None:
        share = affinity / single
        met = "met" if share >= GOAL_HIT_SHARE else "NOT met"
        out.append(f"hit rate: affinity {_pct(affinity)} = {share * 100:.1f} % of the single replica's {_pct(single)} "
                   f"(goal ≥ {GOAL_HIT_SHARE:.0%}): {met}")  # fmt: skip
    rr, aff = _median(by["round_robin"]["ttft"]), _median(by["affinity"]["ttft"])
    if rr and aff is not None:
        met = "met" if aff <= GOAL_TTFT_FACTOR * rr else "NOT met"
        out.append(f"TTFT p50: affinity {_ms(aff)} ms = {aff / rr:.2f}x round robin's {_ms(rr)} ms "
                   f"(goal ≤ {GOAL_TTFT_FACTOR}x): {met}")  # fmt: skip
    for p in phases:
        kill = p.get("kill")
        if kill is None:
            continue
        bound = kill["gateway_in_flight"]
        bound_text = "the gateway named no in-flight count" if bound is None else f"{bound} in flight there"
        cut = kill.get("gateway_cut_mid_stream")
        failed = p["failed"] + (cut or 0)
        met = "unjudged" if bound is None or cut is None else "met" if failed <= bound else "NOT met"
        cut_text = "the gateway's cuts not read" if cut is None else f"{cut:g} of them streams the gateway cut"
        over = kill.get("gateway_failed_over")
        over_text = "" if over is None else f"; {over:g} failed over before their first byte and served"
        out.append(
            f"failover: {failed:g} of {p['requests']} failed ({cut_text}{over_text}); at the kill {bound_text} "
            f"(vLLM's running + waiting: {kill['engine_running_waiting']}): {met}"
        )
    return out


def markdown(report: dict[str, Any]) -> str:
    """pool.md: the goals, then every phase."""
    lines = [f"# Pool: {report['label']}", "", f"Workload: {json.dumps(report['workload'])}", ""]
    lines += [f"- {verdict}" for verdict in verdicts(report["phases"])]
    lines += ["", "| phase | hit rate | TTFT | output | requests | wall |", "| --- | --- | --- | --- | --- | --- |"]
    lines += [_line(p) for p in report["phases"]]
    lines += ["", *(f"- {note}" for note in report["notes"])]
    return "\n".join(lines) + "\n"


def write(out: Path, report: dict[str, Any]) -> None:
    """pool.json and pool.md, rewritten whole."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "pool.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "pool.md").write_text(markdown(report))


def _gateway(text: str) -> tuple[str, str]:
    target, sep, url = text.partition("=")
    if not sep or target not in TARGETS:
        raise argparse.ArgumentTypeError(f"--gateway takes TARGET=URL, TARGET one of {', '.join(TARGETS)}")
    return target, url.rstrip("/")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the step; exit 0 once pool.json is written (the goals are reported, not asserted)."""
    parser = argparse.ArgumentParser(prog="python -m loadtest.gpu.pool", description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--model", type=Path, required=True, help="the model dir (its tokenizer counts and sizes the prompts)")
    add("--replica", action="append", required=True, help="a replica's base URL (twice or more; the last is killed)")
    add("--victim-pgid", type=int, default=0, help="the process group of the last replica's vllm serve")
    add("--gateway", type=_gateway, action="append", default=[], help="TARGET=URL, for single, affinity, round_robin")
    add("--route", choices=("gateway", "client"), default="gateway")
    add("--api-key", default="")
    add("--conversations", type=int, default=49)
    add("--turns", type=int, default=4)
    add("--prefix-tokens", type=int, default=2000)
    add("--turn-tokens", type=int, default=200)
    add("--max-prompt-tokens", type=int, default=3900)
    add("--output-tokens", type=int, default=64)
    add("--concurrency", type=int, default=32)
    add("--rounds", type=int, default=2)
    add("--seed", type=int, default=5000)
    add("--no-failover", dest="failover", action="store_false")
    add("--kill-after", type=float, default=0.3, help="the share of the last replica's requests finished first")
    add("--kill-timeout", type=float, default=120.0, help="kill by then whatever it has finished")
    add("--phase-estimate", type=float, default=45.0, help="seconds a phase is assumed to take before one has run")
    add("--deadline", type=float, default=480.0, help="seconds from now the step must end by")
    add("--out", type=Path, required=True)
    add("--work", type=Path, required=True)
    add("--label", default="")
    args = parser.parse_args(argv)
    args.gateways = dict(args.gateway)
    if args.concurrency > args.conversations:
        parser.error("--concurrency above --conversations would send a turn before its previous one finished")
    if args.route == "gateway" and set(args.gateways) != set(TARGETS):
        parser.error(f"--route gateway needs --gateway for each of {', '.join(TARGETS)}")
    if args.failover and not args.victim_pgid:
        parser.error("failover needs --victim-pgid (or --no-failover)")
    args.work.mkdir(parents=True, exist_ok=True)
    run(Step(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
