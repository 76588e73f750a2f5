"""The shipped Grafana dashboard's panels drawn from a Prometheus, as one PNG (matplotlib, Agg canvas): what an
operator sees before installing Grafana, rendered from real scrapes.

`python -m deploy.grafana.dashboard --prometheus http://127.0.0.1:9090 --minutes 10 --out dashboard.png`. Each panel's
PromQL is taken from nemotron-gateway.json beside it as Grafana would run it (`$__rate_interval` replaced).
Imports nothing from `gateway`; needs matplotlib (the `loadtest` extra).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

DASHBOARD = Path(__file__).resolve().parent / "nemotron-gateway.json"
# What Grafana's `$__rate_interval` becomes here: at least four scrapes of the test's one-second interval.
RATE_INTERVAL = "15s"
_COLUMNS = 3
_DPI = 90


@dataclass(frozen=True)
class Query:
    """One target of one panel."""

    panel: str
    expr: str
    legend: str


def panel_queries(dashboard: dict[str, Any], rate_interval: str = RATE_INTERVAL) -> list[Query]:
    """Every panel's targets, with Grafana's `$__rate_interval` replaced by `rate_interval`."""
    return [
        Query(panel["title"], target["expr"].replace("$__rate_interval", rate_interval), target.get("legendFormat", ""))
        for panel in dashboard["panels"]
        for target in panel["targets"]
    ]


def load_dashboard(path: Path = DASHBOARD) -> dict[str, Any]:
    """The dashboard JSON."""
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def query_range(client: httpx.Client, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
    """Prometheus's `/api/v1/query_range` result (one entry per series)."""
    answer = client.get("/api/v1/query_range", params={"query": expr, "start": start, "end": end, "step": step})
    answer.raise_for_status()
    result: list[dict[str, Any]] = answer.json()["data"]["result"]
    return result


def _legend(template: str, labels: dict[str, str]) -> str:
    text = template
    for name, value in labels.items():
        text = text.replace("{{" + name + "}}", value)
    return text or ",".join(f"{k}={v}" for k, v in labels.items()) or "value"


def render(prometheus: str, out: Path, start: float, end: float, dashboard: dict[str, Any] | None = None) -> Path:
    """Draw every panel of `dashboard` (default: the shipped one) over [start, end] into `out`."""
    dashboard = dashboard or load_dashboard()
    panels = dashboard["panels"]
    rows = math.ceil(len(panels) / _COLUMNS)
    figure = Figure(figsize=(6 * _COLUMNS, 3.2 * rows), layout="constrained")
    FigureCanvasAgg(figure)
    step = max(1.0, (end - start) / 200)
    queries = panel_queries(dashboard)
    with httpx.Client(base_url=prometheus, timeout=30) as client:
        for index, panel in enumerate(panels):
            axes = figure.add_subplot(rows, _COLUMNS, index + 1)
            axes.set_title(panel["title"], fontsize=10)
            drawn = 0
            for query in (q for q in queries if q.panel == panel["title"]):
                for series in query_range(client, query.expr, start, end, step):
                    points = [(float(t) - start, float(v)) for t, v in series["values"] if v not in ("NaN", "+Inf")]
                    if points:
                        xs, ys = zip(*points, strict=True)
                        axes.plot(xs, ys, label=_legend(query.legend, series["metric"]))
                        drawn += 1
            if drawn:
                axes.legend(fontsize=7, loc="upper left")
            else:
                axes.text(0.5, 0.5, "no data (no GPU here)" if "GPU" in panel["title"] else "no data", ha="center")
            axes.set_xlabel("seconds", fontsize=8)
            axes.tick_params(labelsize=7)
    stamp = datetime.fromtimestamp(end, UTC).strftime("%Y-%m-%d %H:%M UTC")
    figure.suptitle(f"nemotron-gateway dashboard, from Prometheus at {prometheus} ({stamp})", fontsize=12)
    figure.savefig(out, dpi=_DPI)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prometheus", default="http://127.0.0.1:9090")
    parser.add_argument("--minutes", type=float, default=15.0, help="how far back to draw")
    parser.add_argument("--out", type=Path, default=Path("dashboard.png"))
    args = parser.parse_args()
    end = time.time()
    render(args.prometheus, args.out, end - args.minutes * 60, end)


if __name__ == "__main__":
    main()
