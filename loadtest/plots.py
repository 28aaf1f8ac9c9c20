"""throughput.png and latency.png: output tok/s, TTFT and TPOT against concurrency, one line per target.

Uses matplotlib's object API (`Figure`, no pyplot): no global figure state and no GUI backend needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from crossover.loadtest.extras import require
from crossover.loadtest.models import Level, Results

THROUGHPUT_PNG = "throughput.png"
LATENCY_PNG = "latency.png"
FIGURE_DPI = 120


@dataclass(frozen=True)
class Series:
    label: str
    levels: list[Level]  # one target's, any order


@dataclass(frozen=True)
class Marker:
    label: str
    concurrency: float


def require_matplotlib() -> None:
    """Fail before a long sweep rather than after it."""
    require("matplotlib.figure", "drawing plots")


def series_of(results: Results, prefix: str = "") -> tuple[list[Series], list[Marker]]:
    """One series per target of a results file, and its crossover marker (if any)."""
    names = list(dict.fromkeys(lv.target for lv in results.levels))
    series = [Series(prefix + name, [lv for lv in results.levels if lv.target == name]) for name in names]
    crossing = results.crossover.concurrency
    markers = [Marker(f"{prefix}crossover C={crossing:.3g}", crossing)] if crossing is not None else []
    return series, markers


def _plot(ax, series: list[Series], field: str, markers: list[Marker], ylabel: str, log_y: bool = False) -> None:
    ticker = require("matplotlib.ticker", "drawing plots")
    levels = sorted({lv.concurrency for s in series for lv in s.levels})
    for s in series:
        values = ((lv.concurrency, getattr(lv, field)) for lv in s.levels)
        points = sorted((c, v) for c, v in values if v is not None)
        if points:
            ax.plot([c for c, _ in points], [v for _, v in points], "o-", label=s.label)
    for i, m in enumerate(markers):
        ax.axvline(m.concurrency, color="black", linestyle=("--", ":", "-.")[i % 3], linewidth=1, label=m.label)
    ax.set_xscale("log")
    # Tick exactly the measured levels, written as plain numbers (log axes default to 10^x labels).
    ax.set_xticks(levels)
    ax.xaxis.set_major_formatter(ticker.ScalarFormatter())
    ax.xaxis.set_minor_locator(ticker.NullLocator())
    if log_y:
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xlabel("concurrency (closed loop)")
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")


def draw(out_dir: Path, series: list[Series], markers: list[Marker], title: str = "") -> list[Path]:
    """Write both PNGs into `out_dir`; returns their paths."""
    figure_cls = require("matplotlib.figure", "drawing plots").Figure
    out_dir.mkdir(parents=True, exist_ok=True)

    fig = figure_cls(figsize=(8, 5), dpi=FIGURE_DPI, layout="constrained")
    _plot(fig.subplots(), series, "output_throughput", markers, "output throughput (tok/s)")
    fig.suptitle(title or "output throughput")
    throughput = out_dir / THROUGHPUT_PNG
    fig.savefig(throughput)

    fig = figure_cls(figsize=(12, 5), dpi=FIGURE_DPI, layout="constrained")
    ttft_ax, tpot_ax = fig.subplots(1, 2)
    # TTFT spans orders of magnitude once requests queue behind a running cap: log scale keeps both visible.
    _plot(ttft_ax, series, "median_ttft_ms", markers, "median TTFT (ms)", log_y=True)
    _plot(tpot_ax, series, "median_tpot_ms", markers, "median TPOT (ms)")
    fig.suptitle(title or "latency")
    latency = out_dir / LATENCY_PNG
    fig.savefig(latency)
    return [throughput, latency]
