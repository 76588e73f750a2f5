"""PNG charts of a results document (matplotlib, Agg canvas, no pyplot state): latency CDF, TTFT and throughput
against the load (concurrency or rate; the profile names in `profiles` mode). The CDFs plot vLLM's per-request
figures as saved; the percentiles drawn are vLLM's own.

Without matplotlib (the `loadtest` extra not installed) no chart is written. Imports nothing from `gateway`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

try:
    from matplotlib.axes import Axes
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
except ImportError:  # the `loadtest` extra is missing: charts are skipped with a warning
    _HAVE_MATPLOTLIB = False
else:
    _HAVE_MATPLOTLIB = True

logger = logging.getLogger(__name__)

CHARTS = ("latency_cdf.png", "ttft_vs_load.png", "throughput_vs_load.png")
_DPI = 110


def write_charts(document: dict[str, Any], out_dir: Path) -> list[Path]:
    """Write the three charts into `out_dir`; the paths written (none without matplotlib)."""
    if not _HAVE_MATPLOTLIB:
        logger.warning("matplotlib is not installed (pip install 'nemotron-gateway[loadtest]'): no charts")
        return []
    points = document["points"]
    written = []
    for name, draw in zip(CHARTS, (_latency_cdf, _ttft_vs_load, _throughput_vs_load), strict=True):
        figure = Figure(figsize=(8, 4.8), layout="constrained")
        FigureCanvasAgg(figure)
        draw(figure, points, document)
        path = out_dir / name
        figure.savefig(path, dpi=_DPI)
        written.append(path)
    return written


def _title(document: dict[str, Any]) -> str:
    return f"{document['target']['model']} · {document['workload']['endpoint']}"


def _cdf(axes: Axes, values: list[float], label: str) -> None:
    ordered = sorted(values)
    count = len(ordered)
    axes.step(ordered, [(i + 1) / count for i in range(count)], where="post", label=label)


def _latency_cdf(figure: Figure, points: list[dict[str, Any]], document: dict[str, Any]) -> None:
    panels = (("latency_ms", "end-to-end latency (ms)"), ("ttft_ms", "time to first token (ms)"))
    axes_list = figure.subplots(1, len(panels), squeeze=False)[0]
    for axes, (key, xlabel) in zip(axes_list, panels, strict=True):
        drawn = False
        for point in points:
            values = [r[key] for r in point["requests"] if r["error"] is None]
            if values:
                _cdf(axes, values, point["label"])
                drawn = True
        axes.set_xlabel(xlabel)
        axes.set_ylabel("fraction of requests")
        axes.set_ylim(0, 1.02)
        axes.grid(True, alpha=0.3)
        if drawn:  # no request succeeded: an empty panel, no legend to draw
            axes.legend(fontsize="small")
    figure.suptitle(f"Latency CDF · {_title(document)}")


def _x_axis(axes: Axes, points: list[dict[str, Any]], document: dict[str, Any]) -> list[float]:
    """Numeric positions: the concurrency or rate, or 0..n-1 labelled with the profile names."""
    if document["kind"] == "profiles":
        axes.set_xticks(range(len(points)), [p["label"] for p in points])
        axes.set_xlabel("engine profile")
        return [float(i) for i in range(len(points))]
    if all(p["concurrency"] is not None for p in points):
        axes.set_xlabel("concurrency (closed loop)")
        xs = [float(p["concurrency"]) for p in points]
    else:
        axes.set_xlabel("request rate, /s (open loop, Poisson)")
        xs = [float(p["rate"] or 0.0) for p in points]
    if len(set(xs)) >= 3 and min(xs) > 0 and max(xs) / min(xs) >= 8:
        axes.set_xscale("log", base=2)  # sweeps double the load: 1, 2, 4, 8, ...
        axes.minorticks_off()
    axes.set_xticks(xs, [f"{x:g}" for x in xs])
    return xs


def _ttft_vs_load(figure: Figure, points: list[dict[str, Any]], document: dict[str, Any]) -> None:
    axes = figure.subplots()
    xs = _x_axis(axes, points, document)
    quantiles = (("p50", "o-"), ("p90", "s--"), ("p99", "^:"))
    for number, (quantile, style) in enumerate(quantiles):
        ys = [_num((p["summary"]["ttft_ms"] or {}).get(quantile)) for p in points]
        if document["kind"] == "profiles":  # no line between unrelated profiles: grouped bars
            axes.bar([x + (number - 1) * 0.25 for x in xs], ys, width=0.25, label=quantile)
        else:
            axes.plot(xs, ys, style, label=quantile)
    axes.set_ylabel("time to first token (ms)")
    axes.set_ylim(bottom=0)
    axes.grid(True, alpha=0.3)
    axes.legend()
    what = "by profile" if document["kind"] == "profiles" else "vs load"
    axes.set_title(f"TTFT {what} · {_title(document)}")


def _throughput_vs_load(figure: Figure, points: list[dict[str, Any]], document: dict[str, Any]) -> None:
    axes = figure.subplots()
    xs = _x_axis(axes, points, document)
    tokens = [p["summary"]["output_tokens_per_s"] for p in points]
    categorical = document["kind"] == "profiles"  # unrelated profiles: markers, no connecting lines
    axes.plot(xs, tokens, "o" if categorical else "o-", color="tab:blue", label="output tokens/s")
    axes.set_ylabel("output tokens/s", color="tab:blue")
    axes.set_ylim(bottom=0)
    axes.grid(True, alpha=0.3)
    right = axes.twinx()
    rps = [p["summary"]["requests_per_s"] for p in points]
    right.plot(xs, rps, "s" if categorical else "s--", color="tab:orange", label="requests/s")
    if any(p["summary"]["goodput"]["per_s"] is not None for p in points):  # only with an objective set
        good = [_num(p["summary"]["goodput"]["per_s"]) for p in points]
        right.plot(xs, good, "^" if categorical else "^:", color="tab:green", label="goodput/s")
    right.set_ylabel("requests/s")
    right.set_ylim(bottom=0)
    handles = axes.get_legend_handles_labels()
    more = right.get_legend_handles_labels()
    axes.legend(handles[0] + more[0], handles[1] + more[1], loc="upper left", fontsize="small")
    what = "by profile" if categorical else "vs load"
    axes.set_title(f"Throughput {what} · {_title(document)}")


def _num(value: float | None) -> float:
    return float("nan") if value is None else float(value)
