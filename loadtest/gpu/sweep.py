"""Direct-to-vLLM and through-the-gateway load points, interleaved, each driven by vLLM's own `vllm bench serve`.

Run where the stack runs (the GPU machine): for every round and concurrency, one point against each
target in alternating order (ABBA), every point with its own seed so no point meets prompts that an
earlier one left in vLLM's prefix cache; random prompts of a fixed length, `ignore_eos`, streamed chat
(loadtest/gpu/bench.py), one client process per `--streams-per-client` streams (one process near a core at 256
streams bounded an earlier run). Then, optionally, the client check: the highest concurrency again over twice as
many client processes per target (the same total tokens/s says the clients were not the bottleneck; each client's
own CPU is recorded too), and a Responses API point per target (a route that is not served is recorded, not
run). CPU seconds per 1,000 output tokens are read for the gateway's processes and vLLM's API-server processes
(descendants of `--root-pid`, told apart by command line). Writes sweep.json and sweep.md into `--out` after
every point. Speaks HTTP only; imports nothing from `gateway`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadtest.gpu import bench
from loadtest.processes import cpu_seconds

_ROLES = ("gateway", "vllm-api", "engine-core")
# The GPU proof's goals: through the gateway at least this share of direct output tokens/s at every
# concurrency, with no errors, and at most this much added TTFT p50 at concurrency 1.
GOAL_TOKENS_SHARE = 0.99
GOAL_ADDED_TTFT_C1_MS = 1.0
# Twice the client processes splitting a point's streams give the same total tokens/s, within this share, when the
# clients were not what bounded it.
CLIENT_CHECK_TOLERANCE = 0.05


def clients_for(concurrency: int, streams_per_client: int) -> int:
    """How many `vllm bench serve` processes drive a point of `concurrency` streams: one per `streams_per_client`."""
    return max(1, -(-concurrency // streams_per_client))


def shares(total: int, parts: int) -> list[int]:
    """`total` split into `parts` whole shares that differ by one at most and add up to it."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def children_by_parent() -> dict[int, list[int]]:
    """Every process id, grouped by its parent's (from /proc)."""
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        tree.setdefault(int(fields[1]), []).append(int(entry))
    return tree


def command_line(pid: int) -> str:
    """A process's command line, arguments joined by spaces (empty once it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as source:
            return source.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def role_of(command: str) -> str | None:
    """Which part of the stack a process is, from its command line (vLLM renames its workers)."""
    if "gateway.supervisor." in command:
        return None  # a process-group guard: it only waits on the process it runs
    if "EngineCore" in command or "VLLM::Worker" in command:
        return "engine-core"
    if "gateway serve" in command or "gateway.http.server" in command:
        return "gateway"
    if "vllm" in command.lower() and ("api_server" in command or "APIServer" in command or " serve" in command):
        return "vllm-api"
    return None


def stack_processes(root: int) -> dict[int, str]:
    """Every descendant of `root` with a role."""
    tree, found, todo = children_by_parent(), {}, [root]
    while todo:
        pid = todo.pop()
        role = role_of(command_line(pid))
        if role is not None:
            found[pid] = role
        todo.extend(tree.get(pid, ()))
    return found


def cpu_by_role(processes: dict[int, str]) -> dict[str, float]:
    """CPU seconds (user + system) so far, summed per role; processes that have gone count 0."""
    totals = dict.fromkeys(_ROLES, 0.0)
    for pid, role in processes.items():
        try:
            user, system = cpu_seconds(pid)
        except OSError:
            continue
        totals[role] += user + system
    return totals


def point_loads(
    args: argparse.Namespace, target: str, concurrency: int, seed: int, *, clients: int = 1, api: str = "chat"
) -> list[bench.Load]:
    """The `vllm bench serve` runs of one point: each client its share of the streams and prompts, seeds apart."""
    prompts = max(args.min_requests, args.prompts_per_stream * concurrency)
    url = args.direct if target == "direct" else args.gateway
    return [
        bench.Load(
            base_url=url,
            tokenizer=args.tokenizer,
            concurrency=streams,
            prompts=share,
            input_len=args.input_len,
            output_len=args.max_tokens,
            seed=seed * 10 + i,
            api=api,
            # A full wave at the point's own concurrency: otherwise the first point at a new level pays for the
            # engine's batch and every connection pool growing to it, and in ABBA's first round that point is
            # always the same target's (at c=256, the gateway's read 89-90 % of direct in both calls of 2026-12-03).
            # At least `min_warmups`: at c=1 one request did not settle a fresh engine (the first point after its
            # start read 19.4 and 25.3 ms TTFT p50 in two calls, the points after it 22.8-23.4).
            warmups=max(streams, args.min_warmups),
        )
        for i, (streams, share) in enumerate(zip(shares(concurrency, clients), shares(prompts, clients), strict=True))
    ]


def run_point(
    args: argparse.Namespace,
    target: str,
    concurrency: int,
    seed: int,
    *,
    clients: int = 1,
    api: str = "chat",
    check: bool = False,
    timeout_s: float = 240.0,
) -> dict[str, Any]:
    """One load point driven by `vllm bench serve` (split over `clients` processes, each its share of the streams
    and prompts, seeds apart); vLLM's figures, the client processes' CPU, and the CPU each role spent during it.
    `check`: a point of the client check, not one the goals judge."""
    loads = point_loads(args, target, concurrency, seed, clients=clients, api=api)
    processes = stack_processes(args.root_pid)
    before = cpu_by_role(processes)
    started = time.monotonic()
    name = f"{api}-{target}-c{concurrency}-x{clients}-s{seed}"
    key = args.api_key if target == "gateway" else None
    running = [bench.start(load, args.work, f"{name}-{i}", key) for i, load in enumerate(loads)]
    results = bench.finish(running, timeout_s)
    wall = time.monotonic() - started
    after = cpu_by_role(processes)
    tokens = sum(r.get("output_tokens") or 0 for r in results)
    errors: Counter[str] = Counter()
    for r in results:
        errors.update(r.get("errors") or {})
        if r.get("completed") is None:
            errors[f"bench exited {r['returncode']}{' (time box)' if r['timed_out'] else ''}"] += 1
    # Several clients: the median of their own percentiles (each saw its share of the same load).
    percentile = {
        name: _median([r[name] for r in results if r.get(name) is not None])
        for name in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")
    }
    first = results[0]
    return {
        "target": target,
        "api": api,
        "clients": clients,
        "check": check,
        # Cut by the sweep's own time box: recorded, not judged (what the target did is unknown).
        "cut": any(r["timed_out"] for r in results),
        "concurrency": concurrency,
        "seed": seed,
        "requests": sum(load.prompts for load in loads),
        "ok": sum(r.get("completed") or 0 for r in results),
        "errors": dict(errors),
        # Clients run side by side: their tokens over the longest one's duration.
        "output_tokens_per_s": tokens / max((r.get("duration_s") or 0.0 for r in results), default=0.0)
        if tokens
        else 0.0,
        **percentile,
        "wall_s": round(wall, 2),
        "client_cpu": [r["client"] for r in results],
        "prompts_realigned": any(r.get("prompts_realigned") for r in results),
        # None without output tokens (a point cut before its first answer, or all errors): nothing to divide by.
        "cpu_s_per_1k_tokens": {
            role: round((after[role] - before[role]) * 1000 / tokens, 4) if tokens else None for role in _ROLES
        },
        "processes": {str(pid): role for pid, role in processes.items()},
        **({"log_tail": first["log_tail"]} if "log_tail" in first else {}),
    }


def responses_status(base_url: str, api_key: str | None, model: str) -> int:
    """The HTTP status of one small non-streamed Responses request (404: the route is not served)."""
    body = json.dumps({"model": model, "input": "Hi", "max_output_tokens": 2, "store": False}).encode()
    request = urllib.request.Request(f"{base_url}/v1/responses", data=body, method="POST")
    request.add_header("Content-Type", "application/json")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as refused:
        return int(refused.code)
    except OSError:
        return 0


def _target(point: dict[str, Any]) -> str:
    extra = [point.get("api", "chat")] if point.get("api", "chat") != "chat" else []
    extra += [f"{point['clients']} clients"] if point.get("clients", 1) > 1 else []
    extra += ["client check"] if point.get("check") else []
    extra += ["cut by the time box"] if point.get("cut") else []
    return str(point["target"]) + (f" ({', '.join(extra)})" if extra else "")


def _client_share(point: dict[str, Any]) -> str:
    shares = [c.get("run_cpu_share") for c in point.get("client_cpu") or ()]
    return " + ".join("-" if share is None else f"{share:.2f}" for share in shares) if shares else "-"


def markdown(points: list[dict[str, Any]]) -> str:
    """The sweep as a Markdown table, one row per point in the order run."""
    lines = [
        "| target | c | ok/requests | errors | output tok/s | TTFT p50/p99 ms | ITL p50/p99 ms | "
        "CPU s/1k tok gateway | vLLM API | engine core | client CPU while running (cores) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for p in points:
        cpu = p["cpu_s_per_1k_tokens"]
        lines.append(
            f"| {_target(p)} | {p['concurrency']} | {p['ok']}/{p['requests']} | {sum(p['errors'].values())} | "
            f"{p['output_tokens_per_s']:,.0f} | {p['ttft_p50_ms']:.1f} / {p['ttft_p99_ms']:.1f} | "
            f"{p['itl_p50_ms']:.2f} / {p['itl_p99_ms']:.2f} | {_cpu(cpu['gateway'])} | {_cpu(cpu['vllm-api'])} | "
            f"{_cpu(cpu['engine-core'])} | {_client_share(p)} |"
        )
    return "\n".join(lines) + "\n"


def _cpu(per_1k: float | None) -> str:
    return "-" if per_1k is None else f"{per_1k:.3f}"


def _median(values: list[float | None]) -> float:
    known = [value for value in values if value is not None]
    return statistics.median(known) if known else float("nan")


def judged(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat points the goals judge (and the chart draws): not the client check's, not the ones the time box cut."""
    return _chat(points)


def _chat(points: list[dict[str, Any]], *, check: bool = False) -> list[dict[str, Any]]:
    """The chat points the goals judge, or (`check`) those of the client check; points the time box cut are left out."""
    return [p for p in points if p.get("api", "chat") == "chat" and bool(p.get("check")) == check and not p.get("cut")]


def goals(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per concurrency, medians over rounds of the chat points (the client check's left out): gateway tokens/s as a
    share of direct, added TTFT and ITL p50 (gateway minus direct, paired by round), errors; each against the goals."""
    points = judged(points)
    rows = []
    for concurrency in sorted({p["concurrency"] for p in points}):
        at = [p for p in points if p["concurrency"] == concurrency]
        direct = [p for p in at if p["target"] == "direct"]
        gateway = [p for p in at if p["target"] == "gateway"]
        pairs = list(zip(direct, gateway, strict=False))
        share = _median(
            [g["output_tokens_per_s"] / d["output_tokens_per_s"] for d, g in pairs if d["output_tokens_per_s"]]
        )
        added_ttft = _median([g["ttft_p50_ms"] - d["ttft_p50_ms"] for d, g in pairs])
        errors = sum(sum(p["errors"].values()) for p in at)
        ok = share >= GOAL_TOKENS_SHARE and errors == 0
        if concurrency == 1:
            ok = ok and added_ttft <= GOAL_ADDED_TTFT_C1_MS
        rows.append(
            {
                "concurrency": concurrency,
                "direct_tokens_per_s": _median([d["output_tokens_per_s"] for d in direct]),
                "gateway_tokens_per_s": _median([g["output_tokens_per_s"] for g in gateway]),
                "gateway_share": share,
                "direct_ttft_p50_ms": _median([d["ttft_p50_ms"] for d in direct]),
                "added_ttft_p50_ms": added_ttft,
                "direct_itl_p50_ms": _median([d["itl_p50_ms"] for d in direct]),
                "gateway_itl_p50_ms": _median([g["itl_p50_ms"] for g in gateway]),
                "gateway_cpu_s_per_1k_tokens": _median([g["cpu_s_per_1k_tokens"]["gateway"] for g in gateway]),
                "vllm_api_cpu_s_per_1k_tokens": _median([d["cpu_s_per_1k_tokens"]["vllm-api"] for d in direct]),
                "errors": errors,
                "meets_goals": ok,
            }
        )
    return rows


def client_check(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per target, the client check's run (twice the client processes, each a smaller share of the streams) against
    the judged points at the same concurrency: the same total tokens/s (within CLIENT_CHECK_TOLERANCE) says their
    clients were not the bottleneck."""
    rows = []
    for split in _chat(points, check=True):
        judged = [
            p for p in _chat(points) if p["target"] == split["target"] and p["concurrency"] == split["concurrency"]
        ]
        tokens = _median([p["output_tokens_per_s"] for p in judged])
        ratio = split["output_tokens_per_s"] / tokens if tokens else float("nan")
        rows.append(
            {
                "target": split["target"],
                "concurrency": split["concurrency"],
                "clients": judged[0].get("clients", 1) if judged else 0,
                "tokens_per_s": tokens,
                "check_clients": split["clients"],
                "check_tokens_per_s": split["output_tokens_per_s"],
                "ratio": ratio,
                "client_bound": not (abs(ratio - 1) <= CLIENT_CHECK_TOLERANCE),
            }
        )
    return rows


def goals_markdown(rows: list[dict[str, Any]]) -> str:
    """The goals table: one row per concurrency."""
    lines = [
        f"| c | output tok/s direct / gateway | gateway share (goal ≥ {GOAL_TOKENS_SHARE:.0%}) | TTFT p50 direct ms | "
        f"added TTFT p50 ms (c=1 goal ≤ {GOAL_ADDED_TTFT_C1_MS:g}) | ITL p50 direct / gateway ms | "
        "CPU s/1k tok gateway / vLLM API | errors | goals |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['concurrency']} | {r['direct_tokens_per_s']:,.0f} / {r['gateway_tokens_per_s']:,.0f} | "
            f"{r['gateway_share']:.1%} | {r['direct_ttft_p50_ms']:.1f} | {r['added_ttft_p50_ms']:+.2f} | "
            f"{r['direct_itl_p50_ms']:.2f} / {r['gateway_itl_p50_ms']:.2f} | "
            f"{r['gateway_cpu_s_per_1k_tokens']:.3f} / {r['vllm_api_cpu_s_per_1k_tokens']:.3f} | {r['errors']} | "
            f"{'met' if r['meets_goals'] else 'MISSED'} |"
        )
    return "\n".join(lines) + "\n"


def client_check_markdown(rows: list[dict[str, Any]]) -> str:
    """The client check: one row per target, its judged points against twice the client processes."""
    lines = [
        "| target | c | clients | tok/s | clients in the check | tok/s | check / judged | clients the bottleneck |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['target']} | {r['concurrency']} | {r['clients']} | {r['tokens_per_s']:,.0f} | "
            f"{r['check_clients']} | {r['check_tokens_per_s']:,.0f} | {r['ratio']:.3f} | "
            f"{'YES' if r['client_bound'] else 'no'} |"
        )
    return "\n".join(lines) + "\n"


def write(out: Path, label: str, points: list[dict[str, Any]], notes: list[str]) -> None:
    """sweep.json and sweep.md from the points so far (called after every point: a time box keeps them)."""
    out.mkdir(parents=True, exist_ok=True)
    summary, clients = goals(points), client_check(points)
    (out / "sweep.json").write_text(
        json.dumps(
            {"label": label, "goals": summary, "client_check": clients, "notes": notes, "points": points}, indent=1
        )
    )
    parts = [label, goals_markdown(summary)] if label else [goals_markdown(summary)]
    if clients:
        parts.append(client_check_markdown(clients))
    parts += [f"- {note}" for note in notes] + [markdown(points)]
    (out / "sweep.md").write_text("\n\n".join(part.rstrip("\n") for part in parts) + "\n")


def plan(concurrency: list[int], rounds: int, first: str = "direct") -> list[tuple[str, int]]:
    """(target, concurrency) in the order run: per round every level, direct and gateway in alternating order, and
    each level's pair in the other order in the next round (ABBA: a drift of the engine over the run favours neither
    target; with one level or three, an order counted over all pairs put the same target first in every round).
    `first` opens the first round's first pair: calls that each fit one round alternate it between them."""
    opening = [first, "gateway" if first == "direct" else "direct"]
    order: list[tuple[str, int]] = []
    for round_index in range(rounds):
        for level_index, level in enumerate(concurrency):
            pair = opening if (round_index + level_index) % 2 == 0 else opening[::-1]
            order += [(target, level) for target in pair]
    return order


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: `python -m loadtest.gpu.sweep --direct URL --gateway URL --api-key KEY --root-pid PID ...`."""
    parser = argparse.ArgumentParser(prog="loadtest.gpu.sweep", description=__doc__)
    parser.add_argument("--direct", required=True, help="vLLM's own base URL, e.g. http://127.0.0.1:8001")
    parser.add_argument("--gateway", required=True, help="the gateway's base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--api-key", required=True, help="a gateway key without limits")
    parser.add_argument("--root-pid", type=int, required=True, help="pid of `nemotron-gateway up`")
    parser.add_argument("--tokenizer", required=True, help="the model dir (its tokenizer makes the prompts)")
    parser.add_argument("--concurrency", default="1,16,64,256")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--input-len", type=int, default=200)
    parser.add_argument("--prompts-per-stream", type=int, default=4)
    parser.add_argument("--min-requests", type=int, default=16)
    parser.add_argument("--seed", type=int, default=1000, help="points take seeds from SEED+1 on")
    parser.add_argument("--first", choices=("direct", "gateway"), default="direct", help="who opens the first pair")
    parser.add_argument("--min-warmups", type=int, default=16, help="warm-up requests a client sends at least")
    parser.add_argument(
        "--streams-per-client", type=int, default=128, help="streams one `vllm bench serve` process drives at most"
    )
    parser.add_argument(
        "--split", action="store_true", help="the client check: the highest concurrency with twice the clients"
    )
    parser.add_argument("--responses-concurrency", type=int, default=0, help="a Responses API point (0: none)")
    parser.add_argument("--point-timeout", type=float, default=240.0, help="seconds one point may take")
    parser.add_argument("--deadline", type=float, default=0.0, help="seconds for the whole sweep (0: none)")
    parser.add_argument("--out", type=Path, required=True, help="where sweep.json and sweep.md go")
    parser.add_argument("--work", type=Path, default=Path("/tmp/gpu-points"), help="each point's own results")
    parser.add_argument("--label", default="", help="what this run's stack is (API servers, gateway workers)")
    args = parser.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]

    def clients(concurrency: int) -> int:
        return clients_for(concurrency, args.streams_per_client)

    steps: list[tuple[str, int, int, str, bool]] = [
        (t, c, clients(c), "chat", False) for t, c in plan(levels, args.rounds, args.first)
    ]
    if args.split:
        top = max(levels)
        steps += [(t, top, min(top, 2 * clients(top)), "chat", True) for t in ("direct", "gateway")]
    if args.responses_concurrency:
        rc = args.responses_concurrency
        steps += [(t, rc, clients(rc), "responses", False) for t in ("direct", "gateway")]
    points: list[dict[str, Any]] = []
    notes: list[str] = []
    started = time.monotonic()
    for seed, (target, concurrency, processes, api, check) in enumerate(steps, start=args.seed + 1):
        if args.deadline and time.monotonic() - started > args.deadline:
            notes.append(f"time box: {target} c={concurrency} x{processes} {api} and later points not run")
            break
        if api == "responses":
            status = responses_status(
                args.direct if target == "direct" else args.gateway,
                args.api_key if target == "gateway" else None,
                "nemotron",
            )
            if status != 200:
                notes.append(f"Responses API {target}: POST /v1/responses answered {status}; point not run")
                write(args.out, args.label, points, notes)
                continue
        left = args.deadline - (time.monotonic() - started) if args.deadline else args.point_timeout
        timeout = max(min(args.point_timeout, left), 10.0)
        point = run_point(args, target, concurrency, seed, clients=processes, api=api, check=check, timeout_s=timeout)
        points.append(point)
        sys.stdout.write(markdown([point]).splitlines()[-1] + "\n")
        sys.stdout.flush()
        write(args.out, args.label, points, notes)
    write(args.out, args.label, points, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
