"""throughput.png and latency.png: output tok/s, TTFT and TPOT against concurrency, one line per target.

What a reader could misread is on the plot itself: each level's 95% interval (error bars), the crossover's
interval (a shaded band), levels with failed requests (marked and counted), and a stand-in's time scale (its
tok/s are wall-clock, i.e. its profile's x the time scale, and its label says so).

Uses matplotlib's object API (`Figure`, no pyplot): no global figure state and no GUI backend needed.
"""

from __future__ import annotations

import math
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
    interval: tuple[float, float] | None = None


def _label(prefix: str, name: str, results: Results) -> str:
    info = results.metadata.targets.get(name)
    simulation = info.simulation if info is not None else None
    if simulation is None or simulation.time_scale is None:
        return prefix + name
    return f"{prefix}{name} (stand-in at {simulation.time_scale:g}x: profile tok/s x {simulation.time_scale:g})"


def require_matplotlib() -> None:
    """Fail before a long sweep rather than after it."""
    require("matplotlib.figure", "drawing plots")


def series_of(results: Results, prefix: str = "") -> tuple[list[Series], list[Marker]]:
    """One series per target of a results file, and its crossover marker (if any)."""
    names = list(dict.fromkeys(lv.target for lv in results.levels))
    series = [
        Series(_label(prefix, name, results), [lv for lv in results.levels if lv.target == name]) for name in names
    ]
    cross = results.crossover
    markers = []
    if cross.concurrency is not None:
        sure = f" (between {cross.interval[0]:g} and {cross.interval[1]:g})" if cross.interval else ""
        markers.append(Marker(f"{prefix}crossover C={cross.concurrency:.3g}{sure}", cross.concurrency, cross.interval))
    elif cross.status == "within_noise" and cross.bracket is not None:
        low, high = cross.bracket
        markers.append(Marker(f"{prefix}no clear crossover C={low}-{high}", math.sqrt(low * high), (low, high)))
    return series, markers


def _plot(ax, series: list[Series], field: str, markers: list[Marker], ylabel: str, log_y: bool = False) -> None:
    ticker = require("matplotlib.ticker", "drawing plots")
    levels = sorted({lv.concurrency for s in series for lv in s.levels})
    for s in series:
        values = ((lv.concurrency, getattr(lv, field)) for lv in s.levels)
        points = sorted((c, v) for c, v in values if v is not None)
        if not points:
            continue
        (line,) = ax.plot([c for c, _ in points], [v for _, v in points], "o-", label=s.label)
        by_c = {lv.concurrency: lv for lv in s.levels}
        if field == "output_throughput":
            bars = [(c, v, by_c[c].output_throughput_interval) for c, v in points]
            known = [(c, v, i) for c, v, i in bars if i is not None]
            if known:
                ax.errorbar(
                    [c for c, _, _ in known],
                    [v for _, v, _ in known],
                    yerr=[[max(v - i[0], 0) for _, v, i in known], [max(i[1] - v, 0) for _, v, i in known]],
                    fmt="none",
                    ecolor=line.get_color(),
                    capsize=3,
                )
        failed = [(c, v, by_c[c].failed) for c, v in points if by_c[c].failed]
        for c, v, n in failed:
            ax.plot([c], [v], "x", color="red", markersize=10)
            ax.annotate(f"{n} failed", (c, v), textcoords="offset points", xytext=(4, 6), fontsize="small", color="red")
    for i, m in enumerate(markers):
        style = ("--", ":", "-.")[i % 3]
        ax.axvline(m.concurrency, color="black", linestyle=style, linewidth=1, label=m.label)
        if m.interval is not None and m.interval[0] < m.interval[1]:
            ax.axvspan(*m.interval, color="grey", alpha=0.15)
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
    _plot(fig.subplots(), series, "output_throughput", markers, "output throughput (tok/s, wall clock; bars: 95%)")
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
