"""`crossover bench report DIR...`: re-draw and compare saved runs without touching any server.

One run: its tables and crossover again, plots re-drawn into the run directory (or `--out`). A run whose
crossover was refused is said to be (in its plots too) and the report exits as its bench did (1).
Several runs: each run's tables, a side-by-side comparison, and plots with every run's targets on the same
axes (labelled `run/target`) in `--out` (default `crossover-report`).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from crossover.loadtest import plots
from crossover.loadtest.bench import apply_recommendation
from crossover.loadtest.models import Results
from crossover.loadtest.results import ResultsError, crossover_section, exit_status, load_results

if TYPE_CHECKING:
    from rich.console import Console

DEFAULT_COMPARE_DIR = Path("crossover-report")


def _labels(dirs: list[Path]) -> list[str]:
    names = [d.name or str(d) for d in dirs]
    return names if len(set(names)) == len(names) else [str(d) for d in dirs]


def run_report(
    dirs: list[Path],
    out: Path | None,
    speculative: str | None,
    plain: str | None,
    draw: bool,
    apply_url: str | None,
    admin_token: str | None,
) -> int:
    from crossover.loadtest.display import make_console, print_crossover, print_errors, print_summary

    console = make_console()
    if draw:
        plots.require_matplotlib()
    if apply_url and len(dirs) != 1:
        print("crossover bench report: --apply takes exactly one run directory", file=sys.stderr)
        return 2
    runs = []
    for d in dirs:
        try:
            run = load_results(d)
        except ResultsError as exc:
            print(f"crossover bench report: {exc}", file=sys.stderr)
            return 1
        if speculative or plain:
            # Re-analysed with other names; the file on disk is left as it was measured.
            run.crossover = crossover_section(
                run.levels,
                speculative or run.crossover.speculative or "speculative",
                plain or run.crossover.plain or "plain",
                run.metadata.targets,
            )
        runs.append(run)

    labels = _labels(dirs)
    for label, run in zip(labels, runs, strict=False):
        print_summary(console, run.levels, title=f"{label}: {run.metadata.model}")
        print_errors(console, run.levels)
        print_crossover(console, run.crossover, run.queueing)
    if len(runs) > 1:
        _compare(console, labels, runs)

    if draw:
        target_dir = out or (dirs[0] if len(dirs) == 1 and dirs[0].is_dir() else DEFAULT_COMPARE_DIR)
        series, markers, notices = [], [], []
        for label, run in zip(labels, runs, strict=False):
            prefix = f"{label}/" if len(runs) > 1 else ""
            s, m = plots.series_of(run, prefix=prefix)
            series += s
            markers += m
            if (notice := plots.refusal_notice(run, prefix=f"{label}: " if prefix else "")) is not None:
                notices.append(notice)
        written = plots.draw(target_dir, series, markers, title=" vs ".join(labels), notices=notices)
        console.print("wrote " + ", ".join(str(p) for p in written))
    refused = [label for label, run in zip(labels, runs, strict=False) if exit_status(run)]
    if refused:
        print(
            f"crossover bench report: REFUSED: {', '.join(refused)}: no crossover was named (see its reason above); "
            "exiting as its bench did",
            file=sys.stderr,
        )
    applied = apply_recommendation(console, runs[0].crossover, apply_url, admin_token)
    # The status the bench itself exited with: a refused run stays a failed one, however often it is re-read.
    return max([applied, *(exit_status(run) for run in runs)])


def _compare(console: Console, labels: list[str], runs: list[Results]) -> None:
    from crossover.loadtest.extras import require

    table = require("rich.table", "bench report").Table(title="runs compared")
    for header in ("run", "model", "in/out tokens", "crossover C", "switch", "spillover", "max tok/s per target"):
        table.add_column(header)
    for label, run in zip(labels, runs, strict=False):
        meta, cross = run.metadata, run.crossover
        rec = cross.recommended_threshold
        peaks: dict[str, float] = {}
        for lv in run.levels:
            peaks[lv.target] = max(peaks.get(lv.target, 0.0), lv.output_throughput)
        c = cross.concurrency
        table.add_row(
            label,
            meta.model,
            f"{meta.input_len}/{meta.output_len}",
            "-" if c is None else f"{c:.2f}",
            "-" if rec is None or rec.switch is None else str(rec.switch),
            "-"
            if rec is None
            else f"{rec.spillover}" + (f", {cross.spillover_share:g}" if cross.spillover_share else ""),
            ", ".join(f"{name} {peak:,.0f}" for name, peak in peaks.items()),
        )
    console.print(table)
