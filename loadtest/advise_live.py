"""`crossover advise --url URL`: what a running gateway has measured - its live rate table and the speculative
backends' acceptance - beside (or, alone, instead of) a bench results file or performance profiles.

    live = read_live("http://gateway:8000", token)      # GET /admin/state (its admin token)
    advice = advise_live(live)                           # with --url alone: a ranking from the live curves
    live_lines(live)                                     # the section every advice given --url prints

The live curves: per pool, each level bucket's per-stream tok/s (completion tokens over request-seconds of the
requests that ran at that level, gateway/backends/rates.py) times the bucket's load (the geometric middle of its
bounds, as the adaptive correction reads it): the pool's throughput at that load, with the requests it rests on. A
level is compared only where both pools served at least MIN_REQUESTS there; its margin is the resolution
(DEFAULT_RESOLUTION) widened by 1/sqrt(requests) - a live table has no intervals of its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import httpx

from crossover.gateway.policies import level_load
from crossover.loadtest.uncertainty import DEFAULT_RESOLUTION

MIN_REQUESTS = 8  # per pool and level, to count it at all
TIMEOUT_S = 10.0


class LiveError(ValueError):
    """The gateway could not be read; the message says why."""


@dataclass(frozen=True)
class LiveLevel:
    level: str
    load: float
    requests: int
    tokens_per_s: float  # the pool's, at `load`


@dataclass
class Live:
    url: str
    threshold: int | None
    accept_length: float | None  # the speculative backends' mean, as the gateway last read it
    bench_accept_length: float | None
    predicted_crossover: float | None
    curves: dict[str, list[LiveLevel]] = field(default_factory=dict)


def read_live(url: str, token: str | None) -> Live:
    """GET /admin/state of a running gateway."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        answer = httpx.get(url.rstrip("/") + "/admin/state", headers=headers, timeout=TIMEOUT_S, trust_env=False)
    except httpx.HTTPError as exc:
        raise LiveError(f"{url}: no answer ({exc})") from None
    if answer.status_code in (401, 403):
        raise LiveError(f"{url}/admin/state refused the admin token (give --admin-token or CROSSOVER_ADMIN_TOKEN)")
    if answer.status_code != 200:
        raise LiveError(f"{url}/admin/state answered {answer.status_code}")
    try:
        state = answer.json()
        return parse_live(url, state)
    except (ValueError, KeyError, TypeError) as exc:
        raise LiveError(f"{url}/admin/state is not a crossover gateway's state: {exc}") from None


def parse_live(url: str, state: dict) -> Live:
    pools = state["pools"]
    readings = [
        backend["accept_length"]
        for backend in pools["speculative"]["backends"]
        if isinstance(backend.get("accept_length"), int | float)
    ]
    adaptive = state.get("adaptive") or {}
    decision = adaptive.get("last_decision") or {}
    prediction = decision.get("prediction") or {}
    curves = {}
    for pool in ("speculative", "plain"):
        rows = []
        for row in pools[pool]["rate_table"]["by_level"]:
            low, _, high = row["level"].rstrip("+").partition("-")
            open_ended = row["level"].endswith("+")
            load = level_load(int(low), None if open_ended else int(high or low))
            if row["tokens_per_s"] is not None:
                rows.append(LiveLevel(row["level"], load, row["requests"], row["tokens_per_s"] * load))
        curves[pool] = rows
    return Live(
        url=url,
        threshold=state.get("threshold"),
        accept_length=sum(readings) / len(readings) if readings else None,
        bench_accept_length=adaptive.get("bench_accept_length"),
        predicted_crossover=prediction.get("crossover"),
        curves=curves,
    )


def compared(live: Live) -> list[tuple[LiveLevel, LiveLevel, float]]:
    """(speculative, plain, margin in tok/s) at each level both pools served MIN_REQUESTS at."""
    plain = {row.level: row for row in live.curves.get("plain", [])}
    out = []
    for spec in live.curves.get("speculative", []):
        other = plain.get(spec.level)
        if other is None or min(spec.requests, other.requests) < MIN_REQUESTS:
            continue
        widen = 1 / math.sqrt(min(spec.requests, other.requests))
        out.append((spec, other, (DEFAULT_RESOLUTION + widen) * max(spec.tokens_per_s, other.tokens_per_s)))
    return out


def live_lines(live: Live) -> list[str]:
    """What the gateway measured, for the advice's `live` section."""
    lines = [f"{live.url}: threshold {live.threshold}"]
    if live.accept_length is None:
        lines.append("acceptance: no speculative backend reports one (no speculation, or not scraped)")
    else:
        bench = (
            "" if live.bench_accept_length is None else f" (the adaptive table's bench: {live.bench_accept_length:.2f})"
        )
        lines.append(f"acceptance: {live.accept_length:.2f} tokens per step{bench}")
    if live.predicted_crossover is not None:
        lines.append(f"adaptive: predicted crossover {live.predicted_crossover:.1f} at the live acceptance")
    for pool, rows in live.curves.items():
        shown = ", ".join(f"{row.level}: {row.tokens_per_s:.1f} tok/s ({row.requests} req)" for row in rows) or "none"
        lines.append(f"{pool} by level: {shown}")
    pairs = compared(live)
    if not pairs:
        lines.append(f"no level where both pools served {MIN_REQUESTS} requests: no live comparison")
    for spec, plain, margin in pairs:
        difference = plain.tokens_per_s - spec.tokens_per_s
        verdict = "tie" if abs(difference) <= margin else "plain ahead" if difference > 0 else "speculative ahead"
        lines.append(
            f"level {spec.level}: speculative {spec.tokens_per_s:.1f} vs plain {plain.tokens_per_s:.1f} tok/s "
            f"(+-{margin:.1f}): {verdict}"
        )
    return lines
