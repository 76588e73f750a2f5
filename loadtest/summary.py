"""`python -m loadtest.summary KIND FILE...`: one small JSON summary of a benchmark run, for the performance page.

A run's full output (records, logs, charts) stays out of git; its summary keeps what the page's table for that
benchmark shows, with the commit and date of the run and the command that reproduces it, in
`loadtest/summaries/<benchmark>-<date>-<commit>.json`. `python -m tools.perf_doc` renders the page from them.

Kinds and what they read:
  overhead FILE...   the `--json` reports of `python -m loadtest.overhead` (`make bench` writes two: default, lean)
  tracing FILE       the `--json` report of `python -m loadtest.overhead --tracing` (off, 100 %, 1 %; `make bench`)
  sweep FILE...      sweep.json of `loadtest/gpu/run bench`, one or several calls of one run, in order
  apis FILE...       sweep.json of a `loadtest/gpu/run bench` with a Responses API point (RESPONSES_C): every API's
                     points, for the table of each API through the gateway against direct
  priority FILE      priority.json of `loadtest/gpu/run priority` (its priority phases; its overload phases too)
  pool FILE          pool.json of `loadtest/gpu/run pool` (two replicas: one alone, affinity, round robin, failover)
  soak FILE          soak.json of `make soak`
  idle FILE...       the JSON lines of `python -m loadtest.idle_cpu`, one per reading
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SUMMARIES = Path(__file__).resolve().parent / "summaries"
BENCHMARKS = ("overhead", "tracing", "gpu-sweep", "gpu-apis", "gpu-pool", "priority", "overload", "soak", "idle")
# Benchmarks whose first run is still to come: the page keeps their table's markers with nothing between them until
# a summary exists (and a summary kept for one of them fails tests/unit/test_perf_doc.py until it leaves this set).
FIRST_RUN_PENDING: frozenset[str] = frozenset()
COMMANDS = {
    "overhead": "make bench",
    "tracing": "make bench",
    "gpu-sweep": "loadtest/gpu/run bench",
    "gpu-apis": "CONCURRENCY=64 RESPONSES_C=64 SPLIT=0 loadtest/gpu/run bench",
    "gpu-pool": "loadtest/gpu/run pool",
    "priority": "loadtest/gpu/run priority",
    "overload": "loadtest/gpu/run priority",
    "soak": "make soak",
    "idle": "python -m loadtest.idle_cpu PID --seconds 30",
}
_POINT_FIELDS = ("target", "api", "concurrency", "clients", "check", "cut", "requests", "ok")
_POINT_FIGURES = ("output_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")
_PHASE_FIGURES = ("completed", "failed", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms")
_POOL_FIELDS = ("name", "target", "round", "requests", "completed", "failed", "errors", "cut", "hit_rate")
_POOL_FIGURES = ("ttft_p50_ms", "ttft_p99_ms", "output_tokens_per_s")


def summary(
    benchmark: str, commit: str, date: str, command: str, setup: str, data: dict[str, Any], run: str = ""
) -> dict[str, Any]:
    """One run's summary: what ran, where in the history, and the figures of its table. `run` tells apart the
    runs of one commit and date (\"2\")."""
    if benchmark not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {benchmark!r}: one of {', '.join(BENCHMARKS)}")
    entry = {"benchmark": benchmark, "commit": commit, "date": date, "command": command, "setup": setup}
    return entry | {"run": run, "data": data}


def path_of(entry: dict[str, Any]) -> Path:
    """Where a summary is kept."""
    stamp = entry["date"].replace(" ", "T").replace(":", "")
    run = f"-run{entry['run']}" if entry.get("run") else ""
    return SUMMARIES / f"{entry['benchmark']}-{stamp}-{entry['commit']}{run}.json"


def load_all(folder: Path = SUMMARIES) -> list[dict[str, Any]]:
    """Every summary kept, oldest first (by date, then run)."""
    entries = [json.loads(path.read_text()) for path in sorted(folder.glob("*.json"))]
    return sorted(entries, key=lambda entry: (entry["date"], entry.get("run", "")))


def write(entry: dict[str, Any]) -> Path:
    """Keep a summary (sorted keys, two-space indent: small diffs)."""
    path = path_of(entry)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(entry, indent=2, sort_keys=True) + "\n")
    return path


def overhead_config(name: str, report: dict[str, Any]) -> dict[str, Any]:
    """The figures of one `loadtest.overhead` report (one configuration) that the table shows."""
    s, targets = report["summary"], report["summary"]["targets"]
    c1 = min(int(key.rpartition("=")[2]) for key in s if key.startswith("non-stream c="))
    return {
        "name": name,
        "cpu_ms_per_request": targets["gateway_cpu_ms_per_request"][0],
        "rps": targets["gateway_rps_saturation"][0],
        "cpu_ms_per_request_c1": s[f"non-stream c={c1}"]["gateway_cpu_ms_per_request"],
        "added_p50_ms_c1": targets["added_p50_ms_c1"][0],
        "us_per_chunk": targets["gateway_cpu_us_per_chunk_slope"][0],
        "nginx_us_per_chunk": targets.get("nginx_cpu_us_per_chunk_slope", [None])[0],
        "chunk_ratio": targets.get("gateway_vs_nginx_per_chunk", [None])[0],
        "chunk_ratio_of_medians": targets.get("gateway_vs_nginx_per_chunk_of_medians", [None])[0],
        "waited_for_cpu": max(v["gateway_run_queue_wait"] for v in s.values() if "gateway_run_queue_wait" in v),
    }


def tracing_configs(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Tracing off, then each traced gateway of one `--tracing` report: its figures, its p99 latency at the highest
    concurrency, and the spans it exported and dropped (none for tracing off)."""
    off = {"spans_exported": None, "spans_dropped": None, "p99_ms": _saturation_p99(report["summary"])}
    configs = [overhead_config("tracing off", report) | off]
    for traced in report["tracing"].values():
        config = overhead_config(f"tracing on, sampled at {traced['ratio']:.0%}", {"summary": traced["summary"]})
        spans = traced.get("spans") or {}
        config |= {"spans_exported": spans.get("exported"), "spans_dropped": spans.get("dropped")}
        configs.append(config | {"p99_ms": _saturation_p99(traced["summary"])})
    return configs


def _saturation_p99(summary: dict[str, Any]) -> float:
    top = max(int(key.rpartition("=")[2]) for key in summary if key.startswith("non-stream c="))
    return float(summary[f"non-stream c={top}"]["gateway_p99_ms"])


def sweep_points(sweeps: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every point of the sweeps, in order, with the fields the table needs."""
    points = []
    for sweep in sweeps:
        for point in sweep["points"]:
            kept = {name: point.get(name) for name in _POINT_FIELDS}
            kept |= {name: _finite(point.get(name)) for name in _POINT_FIGURES}
            cpu = point.get("cpu_s_per_1k_tokens") or {}
            kept["cpu_s_per_1k_tokens"] = {role: cpu.get(role) for role in ("gateway", "vllm-api")}
            points.append(kept)
    return points


def priority_phases(report: dict[str, Any]) -> dict[str, Any]:
    """The interactive key's figures per phase, and vLLM's queue while it ran."""
    phases = {}
    for name, phase in report["phases"].items():
        if not isinstance(phase, dict) or "interactive" not in phase:
            continue
        kept: dict[str, Any] = {"interactive": {k: _finite(phase["interactive"].get(k)) for k in _PHASE_FIGURES}}
        if "engine_queue" in phase:
            kept["engine_queue"] = phase["engine_queue"]
        phases[name] = kept
    return phases


def overload_phases(report: dict[str, Any]) -> dict[str, Any] | None:
    """The overload phases (capacity, through the gateway, direct), or None where the run had none."""
    phases = report["phases"]
    if not all(isinstance(phases.get(name), dict) for name in ("capacity", "overload-gateway", "overload-direct")):
        return None
    keep = ("completed", "failed", "request_goodput", "good_requests", "rate", "ttft_p50_ms", "ttft_p99_ms", "errors")
    out: dict[str, Any] = {"capacity_rps": phases["capacity"]["requests_per_s"]}
    for side in ("gateway", "direct"):
        out[side] = {name: phases[f"overload-{side}"].get(name) for name in keep}
    probe = phases["overload-gateway"].get("shed_probe") or {}
    out["shed_probe"] = {
        k: probe.get(k) for k in ("probes", "shed", "shed_all_well_formed", "shed_ms_p50", "shed_ms_max")
    }
    return out


def pool_phases(report: dict[str, Any]) -> dict[str, Any]:
    """The measured phases (not the warm-up) with each replica's requests, and the failover phase's kill."""
    phases, failover = [], None
    for phase in report["phases"]:
        if phase["name"] == "warm-up":
            continue
        kept = {name: phase.get(name) for name in _POOL_FIELDS}
        kept |= {name: _finite(phase.get(name)) for name in _POOL_FIGURES}
        replicas = phase.get("replicas") or {}
        kept["replica_requests"] = [None if r is None else r["requests"] for r in replicas.values()]
        if "kill" in phase:
            kill = phase["kill"]
            failover = kept | {
                "finished_there_before": kill["finished_there_before"],
                "gateway_in_flight": kill["gateway_in_flight"],
                "engine_running_waiting": kill["engine_running_waiting"],
                "gateway_cut_mid_stream": kill.get("gateway_cut_mid_stream"),
                "gateway_failed_over": kill.get("gateway_failed_over"),
            }
        else:
            phases.append(kept)
    return {
        "label": report.get("label", ""),
        "workload": report["workload"],
        "phases": phases,
        "failover": failover,
        "notes": report.get("notes", []),
    }


def soak_figures(report: dict[str, Any]) -> dict[str, Any]:
    """A soak's tally, growth and verdict."""
    tally, samples, verdict = report["tally"], report["samples"], report["verdict"]
    return {
        "duration_s": report["options"]["duration"],
        "clients": report["options"]["concurrency"],
        "requests": tally["requests"],
        "streams": tally["streams"],
        "abandoned": tally["abandoned"],
        "errors": verdict["errors"],
        "rss_mb": [samples[0]["rss_mb"], samples[-1]["rss_mb"]],
        "rss_growth_mb": verdict["rss_growth_mb"],
        "fds": [samples[0]["fds"], samples[-1]["fds"]],
        "fd_growth": verdict["fd_growth"],
        "passed": verdict["passed"],
    }


def idle_readings(readings: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Ours and vLLM's share of one core: the least and the most over the readings."""
    ours = [reading["ours"]["core_percent"] for reading in readings]
    vllm = [reading["vllm"]["core_percent"] for reading in readings]
    groups = [{"name": "ours in total", "percent": [min(ours), max(ours)]}]
    groups.append({"name": "vLLM's own processes", "percent": [min(vllm), max(vllm)]})
    return {"readings": len(readings), "seconds": readings[0]["seconds"], "groups": groups}


def _finite(value: Any) -> Any:
    return None if isinstance(value, float) and value != value else value


def _load(path: Path) -> Any:
    return json.loads(path.read_text())


def main(argv: Sequence[str] | None = None) -> int:
    """Write the summary of one run; print its path."""
    parser = argparse.ArgumentParser(prog="python -m loadtest.summary", description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=("overhead", "tracing", "sweep", "apis", "pool", "priority", "soak", "idle"))
    parser.add_argument("files", type=Path, nargs="+")
    parser.add_argument("--commit", help="the commit measured (default: the reports' revision, else HEAD's)")
    parser.add_argument("--date", default=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M"))
    parser.add_argument("--setup", default="", help="what ran, in a few words (model, machine, settings)")
    parser.add_argument("--command", help="the command that reproduces the run (default: the kind's usual one)")
    parser.add_argument("--run", default="", help="tells apart several runs of one commit and date")
    args = parser.parse_args(argv)
    commit = args.commit
    entries = []
    if args.kind == "overhead":
        reports = [_load(path) for path in args.files]
        commit = commit or reports[0]["revision"]
        names = ["lean" if report["options"].get("lean") else "default settings" for report in reports]
        data = {"configs": [overhead_config(name, report) for name, report in zip(names, reports, strict=True)]}
        entries.append(("overhead", data))
    elif args.kind == "tracing":
        report = _load(args.files[0])
        commit = commit or report["revision"]
        entries.append(("tracing", {"configs": tracing_configs(report)}))
    elif args.kind == "sweep":
        sweeps = [_load(path) for path in args.files]
        entries.append(("gpu-sweep", {"label": sweeps[0].get("label", ""), "points": sweep_points(sweeps)}))
    elif args.kind == "apis":
        sweeps = [_load(path) for path in args.files]
        entries.append(("gpu-apis", {"label": sweeps[0].get("label", ""), "points": sweep_points(sweeps)}))
    elif args.kind == "pool":
        entries.append(("gpu-pool", pool_phases(_load(args.files[0]))))
    elif args.kind == "priority":
        report = _load(args.files[0])
        entries.append(("priority", {"repeats": [priority_phases(report)]}))
        overload = overload_phases(report)
        if overload is not None:
            entries.append(("overload", overload))
    elif args.kind == "soak":
        report = _load(args.files[0])
        commit = commit or report["revision"]
        entries.append(("soak", soak_figures(report)))
    else:
        readings = [json.loads(line) for path in args.files for line in path.read_text().splitlines() if line]
        entries.append(("idle", idle_readings(readings)))
    if not commit:
        raise SystemExit("--commit is needed: the run's output does not name its commit")
    for benchmark, data in entries:
        command = args.command or COMMANDS[benchmark]
        entry = summary(benchmark, commit, args.date, command, args.setup, data, args.run)
        sys.stdout.write(f"{write(entry)}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
