"""The latency-throughput plot of a `bench serve` sweep, as a PNG: TTFT and TPOT (p50 solid,
p99 dashed) against achieved output tokens/s, one marker per offered load.

matplotlib is optional (`pip install 'llmserve[bench]'`): `require_matplotlib()` runs before
the benchmark, so a missing package fails in a second, not after the sweep. The figure is
drawn on matplotlib's Agg canvas directly, without pyplot, so no global backend is touched.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from benchmarks.sweep import CurvePoint

INSTALL_HINT = "pip install 'llmserve[bench]' (or: pip install 'matplotlib>=3.8')"
# A latency axis turns logarithmic when its values span more than this ratio: TTFT under
# overload grows by orders of magnitude and would flatten the rest of the curve.
LOG_SCALE_RATIO = 30.0


class PlotUnavailableError(RuntimeError):
    """matplotlib is not installed."""


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlotUnavailableError(f"--plot-out needs matplotlib: {INSTALL_HINT}") from None


def _finite(values: Sequence[float]) -> list[float]:
    return [v for v in values if math.isfinite(v) and v > 0]


def _latency_ms(point: CurvePoint, metric: str, percentile: int) -> float:
    """`point.ttft_p50_ms` and its siblings, by metric name and percentile."""
    return float(getattr(point, f"{metric.lower()}_p{percentile}_ms"))


def plot_latency_vs_throughput(points: Sequence[CurvePoint], path: Path, title: str) -> None:
    """Write the PNG. Points keep their order inside a series (the order the load grew in)."""
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not points:
        raise ValueError("nothing to plot: no sweep points")
    figure = Figure(figsize=(11, 4.5), layout="constrained")
    FigureCanvasAgg(figure)
    ttft_axes, tpot_axes = figure.subplots(1, 2)
    series_names = list(dict.fromkeys(point.series for point in points))
    colors = [f"C{i}" for i in range(10)]
    for axes, metric in ((ttft_axes, "TTFT"), (tpot_axes, "TPOT")):
        all_values: list[float] = []
        for index, name in enumerate(series_names):
            series = [point for point in points if point.series == name]
            x = [point.output_tokens_per_s for point in series]
            p50 = [_latency_ms(point, metric, 50) for point in series]
            p99 = [_latency_ms(point, metric, 99) for point in series]
            all_values += p50 + p99
            color = colors[index % len(colors)]
            prefix = f"{name} " if name else ""
            axes.plot(x, p50, "o-", color=color, label=f"{prefix}p50")
            axes.plot(x, p99, "s--", color=color, label=f"{prefix}p99", alpha=0.8)
            for point, y in zip(series, p50, strict=True):
                if math.isfinite(y) and math.isfinite(point.output_tokens_per_s):
                    axes.annotate(
                        point.label,
                        (point.output_tokens_per_s, y),
                        textcoords="offset points",
                        xytext=(4, -10),
                        fontsize=7,
                    )
        finite = _finite(all_values)
        if finite and max(finite) / min(finite) > LOG_SCALE_RATIO:
            axes.set_yscale("log")
        axes.set_xlabel("achieved output tokens/s")
        axes.set_ylabel(f"{metric} (ms)")
        axes.set_title(f"{metric} vs throughput")
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize=8)
    figure.suptitle(title, fontsize=9)
    figure.savefig(path, format="png", dpi=110)
