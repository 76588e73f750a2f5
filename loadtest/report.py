"""The outputs of a run: results.json (see loadtest/schema.py), report.md and the charts, all from one document.

The Markdown is rendered from the document alone, so `python -m loadtest report DIR` redraws a report from a
saved results.json. Its figures are vLLM's benchmark client's, as `loadtest.points` saved them. Imports nothing
from `gateway`.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from loadtest.charts import write_charts
from loadtest.points import Workload, client_version
from loadtest.processes import revision
from loadtest.schema import SCHEMA_VERSION


def build_document(
    kind: str,
    *,
    base_url: str,
    model: str,
    via: str | None,
    workload: Workload,
    points: Sequence[dict[str, Any]],
    failures: dict[str, str],
) -> dict[str, Any]:
    """The results.json document."""
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": kind,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "revision": revision(),
        "client": {"program": "vllm bench serve", "version": client_version()},
        "target": {"base_url": base_url, "model": model, "via": via},
        "workload": workload.as_json(),
        "points": list(points),
        "failures": failures,
    }


def _fmt(value: float | None, digits: int = 0) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _ms(value: float | None) -> str:
    return _fmt(value, 1 if (value or 0) < 100 else 0)


def _quantiles(figures: dict[str, float] | None, names: Sequence[str] = ("p50", "p90", "p99")) -> str:
    return " / ".join(_ms(figures[name] if figures else None) for name in names)


def _gpu(point: dict[str, Any]) -> str:
    used = point["telemetry"]["gpu_used_mib_after"]
    return "n/a" if used is None else f"{used / 1024:.1f} GiB"


def _errors(summary: dict[str, Any]) -> str:
    return ", ".join(f"{reason}: {count}" for reason, count in summary["errors"].items()) or "0"


def _goodput(summary: dict[str, Any]) -> str:
    goodput = summary["goodput"]
    if goodput["requests"] is None:
        return "n/a"
    return f"{goodput['requests']} ({_fmt((goodput['fraction'] or 0) * 100)}%)"


def _client(point: dict[str, Any]) -> str:
    share = point["client"]["run_cpu_share"]
    return "n/a" if share is None else f"{share:.2f} core{' (bound?)' if point['client']['bound'] else ''}"


def _per_stream(summary: dict[str, Any]) -> str:
    """Tokens/s one stream sees: 1000 / vLLM's median TPOT (ms)."""
    tpot = (summary["tpot_ms"] or {}).get("p50")
    return _fmt(1000 / tpot, 1) if tpot else "n/a"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def points_table(document: dict[str, Any]) -> str:
    """One row per point: throughput, TTFT, latency, inter-token latency, goodput, errors, the client, GPU memory."""
    header = [
        "point", "ok / sent", "req/s", "out tok/s", "TTFT p50/p90/p99 ms", "latency p50/p90/p99 ms",
        "ITL p50/p99 ms", "tok/s per stream", "goodput", "errors", "client CPU", "GPU mem",
    ]  # fmt: skip
    rows = []
    for point in document["points"]:
        s = point["summary"]
        rows.append(
            [
                point["label"],
                f"{s['completed']} / {s['completed'] + s['failed']}",
                _fmt(s["requests_per_s"], 2),
                _fmt(s["output_tokens_per_s"], 1),
                _quantiles(s["ttft_ms"]),
                _quantiles(s["e2el_ms"]),
                _quantiles(s["itl_ms"], ("p50", "p99")),
                _per_stream(s),
                _goodput(s),
                _errors(s),
                _client(point),
                _gpu(point),
            ]
        )
    return _table(header, rows)


def profiles_table(document: dict[str, Any]) -> str:
    """The profiles table: profile → P50, P99 (end-to-end latency), tokens/s, GPU memory, TTFT, per stream, errors."""
    header = ["profile", "P50", "P99", "tokens/s", "GPU memory", "TTFT P50", "tok/s per stream", "errors"]
    rows = []
    for point in document["points"]:
        s = point["summary"]
        e2el, ttft = s["e2el_ms"] or {}, s["ttft_ms"] or {}
        rows.append(
            [
                point["label"],
                f"{_fmt(e2el.get('p50'))} ms",
                f"{_fmt(e2el.get('p99'))} ms",
                _fmt(s["output_tokens_per_s"], 1),
                _gpu(point),
                f"{_fmt(ttft.get('p50'))} ms",
                _per_stream(s),
                _errors(s),
            ]
        )
    return _table(header, rows)


def _describe(document: dict[str, Any]) -> str:
    w = document["workload"]
    prompts = w["prompts"]
    if prompts["source"] == "random":
        spread = f" ±{prompts['range_ratio']:.0%}" if prompts["range_ratio"] else ""
        source = f"random prompts of {prompts['input_len']}{spread} tokens"
    else:
        source = f"prompts from {prompts['path']}"
    tokens = "each line's output_tokens" if w["output_len"] is None else f"{w['output_len']} output tokens"
    requests = "rate x duration" if w["requests"] is None else w["requests"]
    warmup = f"{w['warmup']} warm-up request{'' if w['warmup'] == 1 else 's'}"
    via = f" via {document['target']['via']}" if document["target"]["via"] else ""
    client = document["client"]
    where = document["target"]["base_url"] or "each profile's own engine"
    return (
        f"{document['kind']} at {document['revision']}, {document['created']}: `{document['target']['model']}` at "
        f"{where}{via}; {client['program']} (vLLM {client['version']}), {w['endpoint']} "
        f"streamed, {source}, {tokens}{', ignore_eos' if w['ignore_eos'] else ''}; {requests} requests per point "
        f"after {warmup}, the client killed after {w['time_box_s']:g} s."
    )


def render_markdown(document: dict[str, Any], charts: Sequence[str] = ()) -> str:
    """report.md: what ran, the field-report table (profiles), one row per point, failures, charts."""
    parts = [f"# Load test: {document['kind']}", "", _describe(document), ""]
    if document["kind"] == "profiles":
        parts += ["## Profiles", "", profiles_table(document)]
    parts += ["## Points", "", points_table(document)]
    parts.append(
        "Figures are vLLM's benchmark client's. TTFT: time to the first streamed token; ITL: gap between two "
        "streamed tokens (over all streams); tok/s per stream: 1000 / median TPOT; goodput: "
        f"{_objectives(document)}. Client CPU: the client's share of a core while it sent (near 1, it may be what "
        "bounds the point). GPU memory: this machine's GPUs after the point (NVML), n/a without one.\n"
    )
    for label, message in document["failures"].items():
        parts.append(f"- {label} failed: {message.strip().splitlines()[0][:200] if message.strip() else ''}")
    parts += ["", *(f"![{name}]({name})" for name in charts)]
    return "\n".join(parts).rstrip() + "\n"


def _objectives(document: dict[str, Any]) -> str:
    workload = document["workload"]
    chosen = [
        f"{name} <= {workload[key]:g} ms"
        for name, key in (("TTFT", "slo_ttft_ms"), ("latency", "slo_e2el_ms"))
        if workload[key] is not None
    ]
    if not chosen:
        return "n/a, no objective set"
    return "requests that succeeded with " + " and ".join(chosen)


def write_outputs(document: dict[str, Any], out_dir: Path) -> list[Path]:
    """results.json, the charts and report.md in `out_dir` (created); the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    results = out_dir / "results.json"
    results.write_bytes(orjson.dumps(document, option=orjson.OPT_INDENT_2))
    charts = write_charts(document, out_dir)
    report = out_dir / "report.md"
    report.write_text(render_markdown(document, [c.name for c in charts]))
    return [results, report, *charts]
