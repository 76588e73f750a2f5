"""One PNG of GPU sweeps: output tokens/s and ITL p50 against concurrency, direct and through the gateway,
one line pair per sweep.json given (e.g. one and four vLLM API servers). Medians over a sweep's rounds.

`python -m loadtest.gpu.chart OUT.png LABEL=sweep.json [LABEL=sweep.json ...]`. Needs matplotlib (the
`loadtest` extra). Imports nothing from `gateway`.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from loadtest.gpu.sweep import judged

_PANELS = (("output_tokens_per_s", "output tokens/s"), ("itl_p50_ms", "inter-token latency p50 (ms)"))


def medians(points: list[dict[str, Any]], target: str, key: str) -> tuple[list[int], list[float]]:
    """Concurrency levels of one target and the median of `key` at each, in ascending order (the judged points)."""
    by_level: dict[int, list[float]] = {}
    for point in judged(points):
        if point["target"] == target:
            by_level.setdefault(point["concurrency"], []).append(float(point[key]))
    levels = sorted(by_level)
    return levels, [statistics.median(by_level[level]) for level in levels]


def draw(sweeps: dict[str, list[dict[str, Any]]], path: Path) -> None:
    """Write the two panels for every sweep (label -> its points) to `path`."""
    figure = Figure(figsize=(11, 4.5), layout="constrained")
    FigureCanvasAgg(figure)
    for axes, (key, title) in zip(figure.subplots(1, 2), _PANELS, strict=True):
        for label, points in sweeps.items():
            for target, style in (("direct", "o--"), ("gateway", "s-")):
                levels, values = medians(points, target, key)
                axes.plot(levels, values, style, label=f"{label}, {target}")
        axes.set_xscale("log", base=2)
        axes.set_xlabel("concurrent streams")
        axes.set_ylabel(title)
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize="small")
    figure.suptitle("vLLM direct and through nemotron-gateway (NVIDIA H200)")
    figure.savefig(path, dpi=110)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point (see the module docstring)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2 or any("=" not in arg for arg in args[1:]):
        sys.stderr.write(__doc__ or "")
        return 2
    sweeps = {}
    for arg in args[1:]:
        label, _, source = arg.partition("=")
        sweeps[label] = json.loads(Path(source).read_text())["points"]
    draw(sweeps, Path(args[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
