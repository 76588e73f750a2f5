"""Direct-to-vLLM and through-the-gateway load points, interleaved, with each side's CPU time from /proc.

Run where the stack runs (the GPU machine): for every round and concurrency, one point against each
target in alternating order (ABBA), every point with its own seed so no point meets prompts that an
earlier one left in vLLM's prefix cache. CPU seconds per 1,000 output tokens are read for the gateway's
processes and vLLM's API-server processes (descendants of `--root-pid`, told apart by command line).
Writes sweep.json and sweep.md into `--out`. Speaks HTTP only; imports nothing from `gateway`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadtest.processes import cpu_seconds

_ROLES = ("gateway", "vllm-api", "engine-core")
# Issue 11's goals on the GPU: through the gateway at least this share of direct output tokens/s at every
# concurrency, with no errors, and at most this much added TTFT p50 at concurrency 1.
GOAL_TOKENS_SHARE = 0.98
GOAL_ADDED_TTFT_C1_MS = 1.0


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
    if "gateway serve" in command or "gateway.server" in command:
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


def run_point(target: str, url: str, args: argparse.Namespace, concurrency: int, seed: int) -> dict[str, Any]:
    """One load point through the load tool; its summary plus the CPU each role spent during it."""
    out = args.work / f"{target}-c{concurrency}-s{seed}"
    requests = max(args.min_requests, 2 * concurrency)
    argv = [
        sys.executable, "-m", "loadtest", "run", "--base-url", url, "--concurrency", str(concurrency),
        "--requests", str(requests), "--warmup", str(min(concurrency, 16)), "--max-tokens", str(args.max_tokens),
        "--ignore-eos", "--prompt-tokens-mean", str(args.prompt_tokens), "--seed", str(seed), "--quiet",
        "--out", str(out), "--timeout", "600",
    ]  # fmt: skip
    if target == "gateway":
        argv += ["--api-key", args.api_key]
    processes = stack_processes(args.root_pid)
    before = cpu_by_role(processes)
    started = time.monotonic()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    wall = time.monotonic() - started
    after = cpu_by_role(processes)
    point = json.loads((out / "results.json").read_text())["points"][0]
    summary = point["summary"]
    tokens = max(summary["output_tokens"], 1)
    return {
        "target": target,
        "concurrency": concurrency,
        "seed": seed,
        "requests": summary["requests"],
        "ok": summary["ok"],
        "errors": summary["errors"],
        "first_errors": summary["first_errors"],
        "output_tokens_per_s": summary["output_tokens_per_s"],
        "ttft_p50_ms": summary["ttft_ms"]["p50"],
        "ttft_p99_ms": summary["ttft_ms"]["p99"],
        "itl_p50_ms": summary["itl_mean_ms"]["p50"],
        "itl_p99_ms": summary["itl_p99_ms"]["p99"],
        "wall_s": round(wall, 2),
        "cpu_s_per_1k_tokens": {role: round((after[role] - before[role]) * 1000 / tokens, 4) for role in _ROLES},
        "processes": {str(pid): role for pid, role in processes.items()},
    }


def markdown(points: list[dict[str, Any]]) -> str:
    """The sweep as a Markdown table, one row per point in the order run."""
    lines = [
        "| target | c | ok/requests | errors | output tok/s | TTFT p50/p99 ms | ITL p50/p99 ms | "
        "CPU s/1k tok gateway | vLLM API | engine core |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for p in points:
        cpu = p["cpu_s_per_1k_tokens"]
        lines.append(
            f"| {p['target']} | {p['concurrency']} | {p['ok']}/{p['requests']} | {sum(p['errors'].values())} | "
            f"{p['output_tokens_per_s']:,.0f} | {p['ttft_p50_ms']:.1f} / {p['ttft_p99_ms']:.1f} | "
            f"{p['itl_p50_ms']:.2f} / {p['itl_p99_ms']:.2f} | {cpu['gateway']:.3f} | {cpu['vllm-api']:.3f} | "
            f"{cpu['engine-core']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def goals(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per concurrency, medians over rounds: gateway tokens/s as a share of direct, added TTFT and ITL p50
    (gateway minus direct, paired by round), errors; each against issue 11's goals."""
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
                "errors": errors,
                "meets_goals": ok,
            }
        )
    return rows


def goals_markdown(rows: list[dict[str, Any]]) -> str:
    """The goals table: one row per concurrency."""
    lines = [
        f"| c | output tok/s direct / gateway | gateway share (goal ≥ {GOAL_TOKENS_SHARE:.0%}) | TTFT p50 direct ms | "
        f"added TTFT p50 ms (c=1 goal ≤ {GOAL_ADDED_TTFT_C1_MS:g}) | ITL p50 direct / gateway ms | errors | goals |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['concurrency']} | {r['direct_tokens_per_s']:,.0f} / {r['gateway_tokens_per_s']:,.0f} | "
            f"{r['gateway_share']:.1%} | {r['direct_ttft_p50_ms']:.1f} | {r['added_ttft_p50_ms']:+.2f} | "
            f"{r['direct_itl_p50_ms']:.2f} / {r['gateway_itl_p50_ms']:.2f} | {r['errors']} | "
            f"{'met' if r['meets_goals'] else 'MISSED'} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: `python -m loadtest.gpu.sweep --direct URL --gateway URL --api-key KEY --root-pid PID`."""
    parser = argparse.ArgumentParser(prog="loadtest.gpu.sweep", description=__doc__)
    parser.add_argument("--direct", required=True, help="vLLM's own base URL, e.g. http://127.0.0.1:8001/v1")
    parser.add_argument("--gateway", required=True, help="the gateway's base URL")
    parser.add_argument("--api-key", required=True, help="a gateway key without limits")
    parser.add_argument("--root-pid", type=int, required=True, help="pid of `nemotron-gateway up`")
    parser.add_argument("--concurrency", default="1,16,64,256")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=384)
    parser.add_argument("--min-requests", type=int, default=32)
    parser.add_argument("--seed", type=int, default=1000)
    parser.add_argument("--out", type=Path, required=True, help="where sweep.json and sweep.md go")
    parser.add_argument("--work", type=Path, default=Path("/tmp/gpu-points"), help="each point's own results")
    parser.add_argument("--label", default="", help="what this run's stack is (API servers, gateway workers)")
    args = parser.parse_args(argv)
    targets = {"direct": args.direct, "gateway": args.gateway}
    points: list[dict[str, Any]] = []
    seed = args.seed
    for round_index in range(args.rounds):
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            order = ["direct", "gateway"] if (round_index + len(points) // 2) % 2 == 0 else ["gateway", "direct"]
            for target in order:
                seed += 1
                point = run_point(target, targets[target], args, concurrency, seed)
                points.append(point)
                sys.stdout.write(markdown([point]).splitlines()[-1] + "\n")
                sys.stdout.flush()
    args.out.mkdir(parents=True, exist_ok=True)
    summary = goals(points)
    (args.out / "sweep.json").write_text(
        json.dumps({"label": args.label, "goals": summary, "points": points}, indent=1)
    )
    heading = f"{args.label}\n\n" if args.label else ""
    (args.out / "sweep.md").write_text(heading + goals_markdown(summary) + "\n" + markdown(points))
    return 0


if __name__ == "__main__":
    sys.exit(main())
