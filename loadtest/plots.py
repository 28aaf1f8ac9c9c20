"""throughput.png and latency.png: output tok/s, TTFT and TPOT against concurrency, one line per target.

What a reader could misread is on the plot itself: each level's 95% interval (error bars), the crossover's
interval (a shaded band), levels with failed requests (marked and counted), a stand-in's time scale (its
tok/s are wall-clock, i.e. its profile's x the time scale, and its label says so), and a refused run: its
curves are kept as evidence but are not the profile's or the engine's, so every plot of it says REFUSED and
why, in its title, across its axes and in the PNG's Title/Description text chunks.

Uses matplotlib's object API (`Figure`, no pyplot): no global figure state and no GUI backend needed.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from crossover.loadtest.extras import require
from crossover.loadtest.models import Level, Results

THROUGHPUT_PNG = "throughput.png"
LATENCY_PNG = "latency.png"
FIGURE_DPI = 120
NOTICE_WIDTH = 90  # characters per line of a refusal written across a plot


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


def refusal_notice(results: Results, prefix: str = "") -> str | None:
    """`REFUSED: why` for a run whose crossover was refused (its curves must not be read as a verdict)."""
    cross = results.crossover
    if cross.status != "refused":
        return None
    return f"{prefix}REFUSED: {cross.reason or 'see results.json'}"


def _notice(ax, notices: Sequence[str]) -> None:
    text = "\n".join(textwrap.fill(n, NOTICE_WIDTH) for n in notices)
    ax.text(
        0.5,
        0.5,
        text,
        transform=ax.transAxes,
        ha="center",
        va="center",
        fontsize="small",
        color="red",
        bbox={"facecolor": "white", "edgecolor": "red", "alpha": 0.85},
        zorder=10,
    )


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


def draw(
    out_dir: Path, series: list[Series], markers: list[Marker], title: str = "", notices: Sequence[str] = ()
) -> list[Path]:
    """Write both PNGs into `out_dir`; returns their paths. `notices` (a refusal: `refusal_notice`) are written
    across every plot and its title starts with REFUSED."""
    figure_cls = require("matplotlib.figure", "drawing plots").Figure
    out_dir.mkdir(parents=True, exist_ok=True)

    def titled(default: str) -> str:
        return ("REFUSED - " if notices else "") + (title or default)

    def save(fig, path: Path, heading: str) -> None:
        fig.suptitle(heading, color="red" if notices else None)
        fig.savefig(path, metadata={"Title": heading, "Description": "\n".join(notices)})

    fig = figure_cls(figsize=(8, 5), dpi=FIGURE_DPI, layout="constrained")
    ax = fig.subplots()
    _plot(ax, series, "output_throughput", markers, "output throughput (tok/s, wall clock; bars: 95%)")
    if notices:
        _notice(ax, notices)
    throughput = out_dir / THROUGHPUT_PNG
    save(fig, throughput, titled("output throughput"))

    fig = figure_cls(figsize=(12, 5), dpi=FIGURE_DPI, layout="constrained")
    ttft_ax, tpot_ax = fig.subplots(1, 2)
    # TTFT spans orders of magnitude once requests queue behind a running cap: log scale keeps both visible.
    _plot(ttft_ax, series, "median_ttft_ms", markers, "median TTFT (ms)", log_y=True)
    _plot(tpot_ax, series, "median_tpot_ms", markers, "median TPOT (ms)")
    if notices:
        _notice(ttft_ax, notices)
        _notice(tpot_ax, notices)
    latency = out_dir / LATENCY_PNG
    save(fig, latency, titled("latency"))
    return [throughput, latency]
