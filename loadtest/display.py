"""What a person watching a sweep sees: live progress per level, then the summary and the crossover evidence.

Needs rich (the `[bench]` extra). Progress goes to stderr; tables and conclusions go to stdout so they can
be captured; neither matters to the results files.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Self

from crossover.loadtest.client import RequestResult
from crossover.loadtest.extras import require
from crossover.loadtest.models import Crossover, Level, LevelSchedule, Queueing, Simulation
from crossover.loadtest.plan import Target
from crossover.loadtest.standin import describe_lag

if TYPE_CHECKING:
    from rich.console import Console

LOG_WIDTH = 180  # columns when writing to a file or pipe, so the summary table is not squeezed to 80


def make_console(stderr: bool = False) -> Console:
    """A rich Console; wide when not attached to a terminal."""
    rich_console = require("rich.console", "crossover bench")
    out = rich_console.Console(stderr=stderr)
    return out if out.is_terminal else rich_console.Console(stderr=stderr, width=LOG_WIDTH)


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def spillover_text(threshold: int, share: float | None) -> str:
    """`3 (speculative pool holds up to 3)`, or with a share `1, share 0.5 (... up to 1, or 50% of ...)`."""
    if not share:
        return f"{threshold} (speculative pool holds up to {threshold})"
    held = f"{share:.0%} of the requests in flight, rounded up"
    if not threshold:
        return f"0, share {share:g} (speculative pool holds {held})"
    return f"{threshold}, share {share:g} (speculative pool holds up to {threshold}, or {held} where that is more)"


class SweepDisplay:
    """Context manager around a sweep: `level_started` returns the per-request hook for `run_sweep`."""

    def __init__(self) -> None:
        progress = require("rich.progress", "the progress display")
        self.out = make_console()
        errors = make_console(stderr=True)
        self.progress = progress.Progress(
            progress.TextColumn("{task.description}"),
            progress.BarColumn(),
            progress.MofNCompleteColumn(),
            progress.TextColumn("{task.fields[failed]} failed  {task.fields[rate]} tok/s"),
            progress.TimeElapsedColumn(),
            console=errors,
            refresh_per_second=4,
            # In a log (not a terminal) the per-level lines say it all; bars would only repeat them.
            disable=not errors.is_terminal,
        )
        self._error_kinds_seen: set[tuple[str, int, str]] = set()  # (target, C, kind) already explained

    def __enter__(self) -> Self:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def level_started(self, target: Target, concurrency: int, planned: int | None) -> Callable[[RequestResult], None]:
        task = self.progress.add_task(f"{target.name:>12} C={concurrency:<4}", total=planned, failed=0, rate="-")
        started = time.perf_counter()
        tokens = failed = 0

        def on_result(result: RequestResult) -> None:
            nonlocal tokens, failed
            if result.success:
                tokens += result.output_tokens
            else:
                failed += 1
                self.first_error(target.name, concurrency, result)
            rate = tokens / max(time.perf_counter() - started, 1e-9)
            self.progress.update(task, advance=1, failed=failed, rate=f"{rate:,.0f}")

        return on_result

    def first_error(self, target: str, concurrency: int, result: RequestResult) -> None:
        """The first failure of each kind at a level, with its message (the level's count comes with the level)."""
        kind = result.error_kind or "other"
        if (target, concurrency, kind) in self._error_kinds_seen:
            return
        self._error_kinds_seen.add((target, concurrency, kind))
        self.progress.console.print(f"{target:>12} C={concurrency:<4} first {kind}: {result.error}")

    def level_done(self, level: Level, passes: list[LevelSchedule] | None = None) -> None:
        """One line per level; for a stand-in, whether it kept up with its schedule during the passes that count."""
        lagging = [entry for entry in passes or [] if entry.lagging]
        if not passes:
            kept = ""
        elif lagging:
            kept = f"  LAGGING stand-in ({describe_lag(lagging[0])})"
        elif any(entry.lagging is None for entry in passes):
            kept = "  stand-in lag unknown"
        else:
            kept = "  stand-in kept up"
        spread = ""
        if level.pass_output_throughputs:
            spread = f" (passes {', '.join(f'{value:,.1f}' for value in level.pass_output_throughputs)})"
        self.progress.console.print(
            f"{level.target:>12} C={level.concurrency:<4} {level.completed} ok {level.failed} failed  "
            f"{level.output_throughput:,.1f} tok/s{spread}  TTFT p50 {_fmt(level.median_ttft_ms)} ms  "
            f"measured C {level.measured_concurrency:.1f}{kept}"
        )

    def pass_rerun(self, concurrency: int, index: int, behind: dict[str, LevelSchedule]) -> None:
        """A pass a stand-in fell behind in, about to be measured again."""
        who = "; ".join(f"{name} ({describe_lag(entry)})" for name, entry in behind.items())
        self.progress.console.print(
            f"{'':>12} C={concurrency:<4} pass {index + 1}: a stand-in fell behind its schedule, {who}: "
            "measuring the pass again"
        )

    def simulated(self, name: str, simulation: Simulation) -> None:
        scale = "an unknown time scale" if simulation.time_scale is None else f"time scale {simulation.time_scale:g}"
        check = (
            "its clock and the requests its engine held are read before and after every pass of every level"
            if simulation.schedule is not None
            else "it reports no schedule, so whether it keeps up is unknown"
        )
        self.out.print(f"{name}: a simulated server at {scale}; {check}")


def print_summary(console: Console, levels: list[Level], title: str = "crossover bench") -> None:
    table = require("rich.table", "the summary table").Table(title=title)
    columns = [
        ("target", "target", None),
        ("C", "concurrency", None),
        ("ok", "completed", None),
        ("fail", "failed", None),
        ("req/s", "request_throughput", 2),
        ("out tok/s", "output_throughput", 1),
        ("meas. C", "measured_concurrency", 1),
        ("TTFT p50 ms", "median_ttft_ms", 1),
        ("TTFT p99 ms", "p99_ttft_ms", 1),
        ("TPOT p50 ms", "median_tpot_ms", 2),
        ("ITL/chunk p50 ms", "median_itl_ms", 2),
        ("ITL/token p50 ms", "median_token_itl_ms", 2),
        ("E2E p50 ms", "median_e2e_latency_ms", 0),
        ("tok/chunk", "mean_tokens_per_chunk", 2),
        ("errors", "error_kinds", None),
    ]
    for header, *_ in columns:
        table.add_column(header, justify="left" if header == "target" else "right")
    for level in sorted(levels, key=lambda lv: (lv.target, lv.concurrency)):
        values = [(getattr(level, key), digits) for _, key, digits in columns]
        values[-1] = (describe_errors(level), None)
        table.add_row(*(str(value) if digits is None else _fmt(value, digits) for value, digits in values))
    console.print(table)


def describe_errors(level: Level) -> str:
    """`ReadError 104, HTTP 503 2`: a level's failures by kind ("-" for none; by reason in older files)."""
    counts = level.error_kinds or level.errors
    return ", ".join(f"{kind} {count}" for kind, count in counts.items()) or "-"


def print_errors(console: Console, levels: list[Level]) -> None:
    """Each level with failures: its count by kind, and the first failure of each kind with its message."""
    for level in sorted(levels, key=lambda lv: (lv.target, lv.concurrency)):
        if not level.failed:
            continue
        console.print(f"errors: {level.target} C={level.concurrency}: {level.failed} failed ({describe_errors(level)})")
        for kind, message in level.first_errors.items():
            console.print(f"  first {kind}: {message}")


def print_crossover(console: Console, crossover: Crossover, queueing: list[Queueing]) -> None:
    """The evidence behind the crossover and the thresholds, as a reader would check it."""
    for q in queueing:
        console.print(
            f"queueing: {q.target} C={q.from_concurrency}->{q.to_concurrency}: throughput x"
            f"{q.throughput_gain:.2f} while median TTFT x{q.ttft_growth:.1f} "
            "(requests wait for a running slot: check --max-running-requests)"
        )
    if crossover.status == "not_computed":
        console.print(
            "crossover: not computed (name a speculative and a plain target: --target speculative=URL "
            "--target plain=URL, or --speculative NAME --plain NAME)"
        )
        return
    table = require("rich.table", "the crossover table").Table(
        title=f"crossover evidence: {crossover.plain} vs {crossover.speculative}"
    )
    for header in ("C", f"{crossover.speculative} tok/s", f"{crossover.plain} tok/s", "plain/spec", "+-", "ahead", ""):
        table.add_column(header, justify="right")
    bracket = crossover.bracket or ()
    for row in crossover.evidence:
        failures = row.speculative_failed + row.plain_failed
        note = "<- bracket" if row.concurrency in bracket else ""
        if failures:
            note += f" ({failures} failed)"
        table.add_row(
            str(row.concurrency),
            _fmt(row.speculative_output_throughput),
            _fmt(row.plain_output_throughput),
            _fmt(row.plain_over_speculative, 3),
            _fmt(row.margin),
            "no data" if row.verdict == "no_data" else row.verdict or "",
            note,
        )
    console.print(table)
    c, status = crossover.concurrency, crossover.status
    if status == "crossed":
        console.print(
            f"crossover: C = {c:.2f}, interpolated in log C; for sure between C={bracket[0]} (speculative clearly "
            f"ahead) and C={bracket[1]} (plain clearly ahead) - add levels in between to narrow it"
        )
    elif status == "within_noise":
        console.print(f"crossover: {crossover.reason}")
    elif status == "at_or_below_lowest_level":
        console.print(f"crossover: at or below the lowest level, C = {c:g}: plain already meets speculative there")
    elif status == "refused":
        console.print(f"crossover: REFUSED: {crossover.reason}")
    elif status == "no_data":
        console.print(f"crossover: {crossover.reason}")
    else:
        console.print("crossover: not reached: speculative delivers more at every level measured")
    if status not in ("refused", "no_data", "within_noise") and crossover.reason:
        console.print(f"note: {crossover.reason}")
    rec = crossover.recommended_threshold
    if rec is None:
        return
    efficiency = crossover.spillover_worst_case_efficiency
    if rec.switch is None:
        switch = "none (too close to call: any threshold in the range serves about as well)"
    elif rec.switch == 0:
        switch = "0 (never speculative: plain leads from one stream on)"
    else:
        switch = f"{rec.switch} (speculative while total in-flight < {rec.switch})"
    spillover = spillover_text(rec.spillover, crossover.spillover_share)
    console.print(
        f"recommended threshold: switch = {switch}; spillover = {spillover}"
        f" (predicted worst-case {_fmt(None if efficiency is None else 100 * efficiency)}% of the best split)"
    )
