"""The proxy benchmark's verdict: the bar checked line by line, and the table as text or markdown.

Rows are `harness.run` output: one per cell and target, each a target's rounds of that cell `combine`d, plus
`kind` (stream / non-stream / paced), `target` (direct, crossover, or a peer: any other name) and `ratio`
(req/s over direct's in the same cell). The bar judges what holds whatever the core count - CPU per request,
from /proc - and added latency, each the median of its rounds; req/s stays in the table. A CPU line also shows
crossover's over the cheapest peer's round by round, so a verdict inside one round's noise shows as one. A bar
line whose inputs were not measured (a target or a cell left out) is reported as SKIP, not FAIL.
"""

from __future__ import annotations

import collections
import statistics
from dataclasses import dataclass

DIRECT, CROSSOVER = "direct", "crossover"
# Crossover's variants, each measured against crossover (not peers): with [cluster] redis_url set, and one process
# (no --workers) beside a run whose crossover has --workers N.
CROSSOVER_REDIS, CROSSOVER_ONE = "crossover-redis", "crossover-w1"
VARIANTS = (CROSSOVER_REDIS, CROSSOVER_ONE)
# The bar (issues 3 and 20).
TTFC_ADDED_MAX_MS = 2.0  # crossover's added p50 time to first chunk at C=1, streaming
PACED_RPS_FRACTION = 0.97  # of direct's req/s in the paced run
PACED_TTFC_ADDED_MAX_MS = 10.0  # over direct's p50 time to first chunk in the paced run
REDIS_CPU_MAX_RATIO = 1.05  # crossover's CPU per request with Redis configured over without (issue 31)
CPU = "cpu_ms_per_request"
CPU_ROUNDS = "cpu_rounds"  # each round's CPU per request, in the order they ran
_SUMMED = ("sent", "ok", "completed", "errors", "window_errors", "cpu_s", "window_s")
_MEDIAN = ("rps", "latency_p50_ms", "latency_p99_ms", "ttfc_p50_ms", "ttfc_p99_ms", CPU)


def combine(reports: list[dict]) -> dict:
    """One target's rounds of one cell (loadgen reports) as one row: each rate, latency and CPU per request the
    median of its rounds (None if no round measured it), counts and times summed, error kinds merged, and every
    round's CPU per request kept (`cpu_rounds`) to show the spread. A median of rounds run in turn with the
    other targets' is what one noisy window cannot be: on 2 shared cores one target's CPU per request moves by
    up to 60% from one run to the next."""
    row = dict(reports[0])
    for key in _MEDIAN:
        values = [report[key] for report in reports if report.get(key) is not None]
        row[key] = round(statistics.median(values), 4) if values else None
    for key in _SUMMED:
        values = [report[key] for report in reports if report.get(key) is not None]
        row[key] = round(sum(values), 3) if values else None
    kinds: collections.Counter[str] = collections.Counter()
    for report in reports:
        kinds.update(report.get("error_kinds", {}))
    row["error_kinds"] = dict(kinds)
    row["rounds"] = len(reports)
    row[CPU_ROUNDS] = [report.get(CPU) for report in reports]
    return row


@dataclass
class Bar:
    line: str
    passed: bool | None  # None: not measured in this run
    detail: str

    @property
    def verdict(self) -> str:
        return {True: "PASS", False: "FAIL", None: "SKIP"}[self.passed]


def _row(rows: list[dict], kind: str, concurrency: int, target: str) -> dict | None:
    return next((r for r in rows if (r["kind"], r["concurrency"], r["target"]) == (kind, concurrency, target)), None)


def _added(rows: list[dict], kind: str, concurrency: int, target: str, metric: str) -> float | None:
    row, direct = _row(rows, kind, concurrency, target), _row(rows, kind, concurrency, DIRECT)
    if row is None or direct is None or row[metric] is None or direct[metric] is None:
        return None
    return row[metric] - direct[metric]


def _by_round(ours: dict, theirs: dict) -> str:
    """Our CPU per request over theirs in each round (the two ran in the same round, a few windows apart): how far
    one round's noise reaches, beside the medians the verdict compares. Empty where a row has no rounds."""
    pairs = zip(ours.get(CPU_ROUNDS, ()), theirs.get(CPU_ROUNDS, ()), strict=False)
    return ", ".join(f"{a / b:.2f}" for a, b in pairs if a is not None and b)


def peers(rows: list[dict]) -> list[str]:
    """The peer targets in `rows`, in their order."""
    return list(dict.fromkeys(r["target"] for r in rows if r["target"] not in (DIRECT, CROSSOVER, *VARIANTS)))


def check_bar(rows: list[dict]) -> list[Bar]:
    bars = []
    others = peers(rows)
    for kind, c in dict.fromkeys((r["kind"], r["concurrency"]) for r in rows):
        line = f"{kind} C={c}: crossover's CPU per request <= every peer's"
        ours = _row(rows, kind, c, CROSSOVER)
        measured = {name: row for name in others if (row := _row(rows, kind, c, name)) and row.get(CPU) is not None}
        theirs = {name: row[CPU] for name, row in measured.items()}
        if ours is None or ours.get(CPU) is None or not theirs:
            bars.append(Bar(line, None, "not measured"))
            continue
        detail = ", ".join(f"{name} {ms:.3f} ms" for name, ms in theirs.items())
        closest = min(theirs, key=theirs.__getitem__)
        spread = _by_round(ours, measured[closest])
        detail += f"; over {closest}, round by round: {spread}" if spread else ""
        bars.append(Bar(line, ours[CPU] <= theirs[closest], f"crossover {ours[CPU]:.3f} ms; {detail}"))

    for kind in ("stream", "non-stream"):
        line = f"{kind} C=1: crossover's added p50 latency <= the best peer's"
        ours = _added(rows, kind, 1, CROSSOVER, "latency_p50_ms")
        theirs = {name: ms for name in others if (ms := _added(rows, kind, 1, name, "latency_p50_ms")) is not None}
        if ours is None or not theirs:
            bars.append(Bar(line, None, "not measured"))
            continue
        detail = ", ".join(f"{name} +{ms:.3f} ms" for name, ms in theirs.items())
        bars.append(Bar(line, ours <= min(theirs.values()), f"crossover +{ours:.3f} ms; {detail}"))

    ours = _added(rows, "stream", 1, CROSSOVER, "ttfc_p50_ms")
    line = f"stream C=1: crossover's added p50 time to first chunk < {TTFC_ADDED_MAX_MS:g} ms"
    bars.append(
        Bar(line, None, "not measured") if ours is None else Bar(line, ours < TTFC_ADDED_MAX_MS, f"+{ours:.3f} ms")
    )

    paced = [r for r in rows if r["kind"] == "paced"]
    c = paced[0]["concurrency"] if paced else 0
    cell = f"paced C={c}" if paced else "paced"
    ours, direct = _row(rows, "paced", c, CROSSOVER), _row(rows, "paced", c, DIRECT)
    line = f"{cell}: crossover passes >= {PACED_RPS_FRACTION:.0%} of direct's req/s"
    if ours is None or direct is None:
        bars.append(Bar(line, None, "not measured"))
    else:
        bars.append(Bar(line, ours["rps"] >= PACED_RPS_FRACTION * direct["rps"], f"{ours['ratio']:.1%} of direct"))
    added = _added(rows, "paced", c, CROSSOVER, "ttfc_p50_ms")
    line = f"{cell}: crossover's p50 time to first chunk <= direct's + {PACED_TTFC_ADDED_MAX_MS:g} ms"
    bars.append(
        Bar(line, None, "not measured")
        if added is None
        else Bar(line, added <= PACED_TTFC_ADDED_MAX_MS, f"+{added:.3f} ms")
    )

    bars += _redis_bars(rows) + _workers_bars(rows)
    ours_rows = [r for r in rows if r["target"] == CROSSOVER]
    errors = sum(r["errors"] for r in ours_rows)
    bars.append(
        Bar(
            "no failed requests through crossover",
            errors == 0 if ours_rows else None,
            f"{errors} errors in {sum(r['sent'] for r in ours_rows)} requests",
        )
    )
    return bars


def _redis_bars(rows: list[dict]) -> list[Bar]:
    """Per cell where both ran: crossover with Redis configured costs at most REDIS_CPU_MAX_RATIO of its CPU per
    request without (nothing per request goes to Redis). No line at all where crossover-redis did not run."""
    bars = []
    for kind, c in dict.fromkeys((r["kind"], r["concurrency"]) for r in rows if r["target"] == CROSSOVER_REDIS):
        line = f"{kind} C={c}: crossover's CPU per request with Redis <= {REDIS_CPU_MAX_RATIO:g}x without"
        with_redis, without = _row(rows, kind, c, CROSSOVER_REDIS), _row(rows, kind, c, CROSSOVER)
        if with_redis is None or without is None or not with_redis.get(CPU) or not without.get(CPU):
            bars.append(Bar(line, None, "not measured"))
            continue
        ratio = with_redis[CPU] / without[CPU]
        detail = f"{with_redis[CPU]:.3f} / {without[CPU]:.3f} ms = {ratio:.3f}"
        spread = _by_round(with_redis, without)
        detail += f"; round by round: {spread}" if spread else ""
        bars.append(Bar(line, ratio <= REDIS_CPU_MAX_RATIO, detail))
    return bars


def _workers_bars(rows: list[dict]) -> list[Bar]:
    """Per cell where both ran: crossover with its workers passes at least the req/s of one process (issue 31: on 2
    cores, --workers 2 no worse than 1). No line at all where crossover-w1 did not run."""
    bars = []
    for kind, c in dict.fromkeys((r["kind"], r["concurrency"]) for r in rows if r["target"] == CROSSOVER_ONE):
        line = f"{kind} C={c}: crossover's req/s with its workers >= with one process"
        ours, one = _row(rows, kind, c, CROSSOVER), _row(rows, kind, c, CROSSOVER_ONE)
        if ours is None or one is None or not one["rps"]:
            bars.append(Bar(line, None, "not measured"))
            continue
        detail = f"{ours['rps']:.0f} / {one['rps']:.0f} req/s = {ours['rps'] / one['rps']:.3f}"
        detail += f"; CPU ms/request {ours[CPU]} / {one[CPU]}"
        bars.append(Bar(line, ours["rps"] >= one["rps"], detail))
    return bars


HEADER = (
    "run",
    "C",
    "target",
    "CPU ms/req",
    "CPU range",
    "req/s",
    "x direct",
    "p50 ms",
    "p99 ms",
    "TTFC p50",
    "TTFC p99",
    "errors",
)


def _cells(row: dict) -> tuple[str, ...]:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    streamed = row["kind"] != "non-stream"
    ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}"
    rounds = [cpu for cpu in row.get(CPU_ROUNDS, ()) if cpu is not None]
    return (
        row["kind"],
        str(row["concurrency"]),
        row["target"],
        "-" if row.get(CPU) is None else f"{row[CPU]:.3f}",
        f"{min(rounds):.3f}-{max(rounds):.3f}" if len(rounds) > 1 else "-",
        f"{row['rps']:.0f}",
        ratio,
        ms(row["latency_p50_ms"]),
        ms(row["latency_p99_ms"]),
        ms(row["ttfc_p50_ms"]) if streamed else "-",
        ms(row["ttfc_p99_ms"]) if streamed else "-",
        str(row["errors"]),
    )


def render_text(rows: list[dict], bars: list[Bar]) -> str:
    table = [HEADER] + [_cells(row) for row in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(HEADER))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(line, widths, strict=False)) for line in table]
    lines.append("")
    lines += [f"{bar.verdict}  {bar.line} ({bar.detail})" for bar in bars]
    return "\n".join(lines)


def summary_table(rows: list[dict]) -> list[list[str]]:
    """Issue 31's table: a line per cell's req/s (x direct), the paced run's TTFT p50 and each cell's CPU per
    request, a column per target, and crossover over the best peer (above 1 is better for req/s, below 1 for
    time and CPU). Its first line is the header."""
    targets = list(dict.fromkeys(r["target"] for r in rows))
    others = peers(rows)
    lines = [["cell", *targets, "crossover / best peer"]]

    def line(label: str, metric: str, kind: str, c: int, higher_is_better: bool) -> None:
        found = {t: row[metric] for t in targets if (row := _row(rows, kind, c, t)) and row.get(metric) is not None}
        cells = []
        for t in targets:
            value = found.get(t)
            if value is None:
                cells.append("-")
            elif metric == "rps":
                ratio = _row(rows, kind, c, t)["ratio"]
                cells.append(f"{value:.0f}" + ("" if t == DIRECT or ratio is None else f" ({ratio:.2f}x)"))
            else:
                cells.append(f"{value:.3f}" if metric == CPU else f"{value:.1f}")
        theirs = [found[t] for t in others if t in found]
        best = (max if higher_is_better else min)(theirs) if theirs else None
        ours = found.get(CROSSOVER)
        lines.append([label, *cells, f"{ours / best:.2f}" if ours is not None and best else "-"])

    cells = list(dict.fromkeys((r["kind"], r["concurrency"], r.get("max_tokens")) for r in rows))
    for kind, c, tokens in cells:
        name = f"{kind} {tokens} tokens" if kind != "non-stream" and tokens else kind
        line(f"{name}, C={c}: req/s", "rps", kind, c, True)
        if kind == "paced":
            line(f"{name}, C={c}: TTFT p50 ms", "ttfc_p50_ms", kind, c, False)
    for kind, c, _ in cells:
        line(f"CPU ms per request, {kind} C={c}", CPU, kind, c, False)
    return lines


def render_summary(rows: list[dict]) -> str:
    """`summary_table` as markdown (what issue 31 shows)."""
    table = summary_table(rows)
    out = ["| " + " | ".join(table[0]) + " |", "|" + "---|" * len(table[0])]
    return "\n".join(out + ["| " + " | ".join(line) + " |" for line in table[1:]])


def render_markdown(
    rows: list[dict],
    bars: list[Bar],
    command: str,
    targets: dict[str, str] | None = None,
    skipped: dict[str, str] | None = None,
) -> str:
    """The command, how each target was started (`targets`: {name: command line}) or why it was left out
    (`skipped`), the summary, the table and the bar. CPU ms/req is the target's whole process tree (the backend's,
    for direct) over the window: the median of the rounds, whose lowest and highest are its range."""
    lines = [f"`{command}`", ""]
    lines += [f"- {name}: `{started}`" for name, started in (targets or {}).items()]
    lines += [f"- {name}: left out: {reason}" for name, reason in (skipped or {}).items()]
    lines += ["", render_summary(rows)]
    lines += ["", "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(_cells(row)) + " |" for row in rows]
    lines += ["", "| bar | result | measured |", "|---|---|---|"]
    lines += [f"| {bar.line} | {bar.verdict} | {bar.detail} |" for bar in bars]
    return "\n".join(lines) + "\n"
