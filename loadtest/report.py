"""The outputs of a run: results.json (see loadtest/schema.py), report.md and the charts, all from one document.

The Markdown is rendered from the document alone, so `python -m loadtest report DIR` redraws a report from a
saved results.json. Imports nothing from `gateway`.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from loadtest.charts import write_charts
from loadtest.processes import revision
from loadtest.runner import Plan, Point
from loadtest.schema import SCHEMA_VERSION
from loadtest.traffic import Traffic


def build_document(
    kind: str, *, base_url: str, model: str, via: str | None, traffic: Traffic, plan: Plan, points: Sequence[Point]
) -> dict[str, Any]:
    """The results.json document."""
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": kind,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "revision": revision(),
        "target": {"base_url": base_url, "model": model, "via": via},
        "workload": {
            **traffic.describe(),
            "requests": plan.requests,
            "duration_s": plan.duration,
            "warmup": plan.warmup,
            "timeout_s": plan.timeout,
        },
        "points": [point.as_json() for point in points],
    }


def _fmt(value: float | None, digits: int = 0) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _triple(dist: dict[str, Any]) -> str:
    return " / ".join(_fmt(dist[q], 1 if (dist[q] or 0) < 100 else 0) for q in ("p50", "p90", "p99"))


def _gpu(point: dict[str, Any]) -> str:
    used = point["telemetry"]["gpu_used_mib_after"]
    return "n/a" if used is None else f"{used / 1024:.1f} GiB"


def _errors(summary: dict[str, Any]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in summary["errors"].items()) or "0"


def points_table(document: dict[str, Any]) -> str:
    """One row per point: throughput, TTFT, latency, inter-token latency, goodput, errors, GPU memory."""
    header = [
        "point",
        "ok / sent",
        "req/s",
        "out tok/s",
        "TTFT p50/p90/p99 ms",
        "latency p50/p90/p99 ms",
        "ITL mean p50 ms",
        "ITL p99 p50 ms",
        "tok/s per stream p50",
        "goodput",
        "errors",
        "GPU mem",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for point in document["points"]:
        s = point["summary"]
        goodput = s["goodput"]
        lines.append(
            "| "
            + " | ".join(
                [
                    point["label"],
                    f"{s['ok']} / {s['requests']}",
                    _fmt(s["requests_per_s"], 2),
                    _fmt(s["output_tokens_per_s"], 1),
                    _triple(s["ttft_ms"]),
                    _triple(s["latency_ms"]),
                    _fmt(s["itl_mean_ms"]["p50"], 1),
                    _fmt(s["itl_p99_ms"]["p50"], 1),
                    _fmt(s["stream_tokens_per_s"]["p50"], 1),
                    f"{goodput['requests']} ({_fmt((goodput['fraction'] or 0) * 100)}%)",
                    _errors(s),
                    _gpu(point),
                ]
            )
            + " |"
        )
    return "\n".join(lines) + "\n"


def profiles_table(document: dict[str, Any]) -> str:
    """The profiles table: profile → P50, P99 (end-to-end latency), tokens/s, GPU memory."""
    header = ["profile", "P50", "P99", "tokens/s", "GPU memory", "TTFT P50", "tok/s per stream", "errors"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for point in document["points"]:
        s = point["summary"]
        lines.append(
            f"| {point['label']} | {_fmt(s['latency_ms']['p50'])} ms | {_fmt(s['latency_ms']['p99'])} ms | "
            f"{_fmt(s['output_tokens_per_s'], 1)} | {_gpu(point)} | {_fmt(s['ttft_ms']['p50'])} ms | "
            f"{_fmt(s['stream_tokens_per_s']['p50'], 1)} | {_errors(s)} |"
        )
    return "\n".join(lines) + "\n"


def _describe(document: dict[str, Any]) -> str:
    w = document["workload"]
    prompts = w["prompts"]
    if prompts["source"] == "synthetic":
        shape = f"{prompts['distribution']} lengths mean {prompts['mean']:g} sd {prompts['stddev']:g} words"
        source = f"synthetic prompts, {shape}"
    else:
        source = f"{prompts['count']} prompts from {prompts['path']}"
    low, high = w["max_tokens"]
    tokens = f"max_tokens {low}" if low == high else f"max_tokens {low}-{high}"
    via = f" via {document['target']['via']}" if document["target"]["via"] else ""
    return (
        f"{document['kind']} at {document['revision']}, {document['created']}: `{document['target']['model']}` at "
        f"{document['target']['base_url']}{via}; {w['endpoint']} {'stream' if w['stream'] else 'non-stream'}, "
        f"{source}, {tokens}{', ignore_eos' if w['ignore_eos'] else ''}; up to {w['requests']} requests or "
        f"{w['duration_s']:g} s per point after {w['warmup']} warm-up requests."
    )


def render_markdown(document: dict[str, Any], charts: Sequence[str] = ()) -> str:
    """report.md: what ran, the field-report table (profiles), one row per point, first errors, charts."""
    parts = [f"# Load test: {document['kind']}", "", _describe(document), ""]
    if document["kind"] == "profiles":
        parts += ["## Profiles", "", profiles_table(document)]
    parts += ["## Points", "", points_table(document)]
    parts.append(
        "TTFT: time to the first streamed token; ITL: gap between two streamed tokens (mean, and each stream's "
        f"p99, then the median over streams); goodput: {_objectives(document)}. "
        "GPU memory: this machine's GPUs after the point (NVML), n/a without one.\n"
    )
    for point in document["points"]:
        for outcome, detail in point["summary"]["first_errors"].items():
            parts.append(f"- {point['label']}: first `{outcome}`: {detail[:200]}")
    parts += ["", *(f"![{name}]({name})" for name in charts)]
    return "\n".join(parts).rstrip() + "\n"


def _objectives(document: dict[str, Any]) -> str:
    points = document["points"]
    goodput = points[0]["summary"]["goodput"] if points else {}
    set_ = [
        f"{name} <= {goodput[key]:g} ms"
        for name, key in (("TTFT", "slo_ttft_ms"), ("latency", "slo_latency_ms"))
        if goodput.get(key) is not None
    ]
    if not set_:
        return "no objective set, so every successful request counts"
    return "requests that succeeded with " + " and ".join(set_)


def write_outputs(document: dict[str, Any], out_dir: Path) -> list[Path]:
    """results.json, the charts and report.md in `out_dir` (created); the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    results = out_dir / "results.json"
    results.write_bytes(orjson.dumps(document, option=orjson.OPT_INDENT_2))
    charts = write_charts(document, out_dir)
    report = out_dir / "report.md"
    report.write_text(render_markdown(document, [c.name for c in charts]))
    return [results, report, *charts]
