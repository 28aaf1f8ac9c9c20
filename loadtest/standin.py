"""Targets that are a simulated SGLang server (crossover's stand-in): their time scale and whether they kept up.

At a high `--time-scale` on a busy machine the stand-in falls behind its own schedule, and what it delivers is
then the machine's speed, not the profile's (a sweep at 100x on two cores measured 47-65% of the profile's
throughput): enough to move or hide a crossover. The stand-in says so in `/server_info`:

    {"simulated": true, "simulator": {"time_scale": 100.0, ...},
     "schedule": {"time_scale": 100.0, "lag_s": 2.3, "max_lag_s": 4.1, "speed_ratio": 0.55, "lagging": true}}

`crossover bench` reads it before the sweep, and right before and right after each pass of a level of a simulated
target: the stand-in's own clock (`clock_s`, profile seconds) against the wall time between the two reads gives
the speed over the *whole* pass - a stand-in that fell behind in the middle of a pass and caught up by its end
still counts as lagging there. A pass where one did is measured again (runner.py: a few slow seconds cost that
pass, not the run); only a level that still lagged once its reruns were spent names no crossover for the pair.
It records every pass in results.json (`metadata.targets[NAME].simulation`, reruns marked). Read
tolerantly: a field that is absent or not of its type is unknown (null), never guessed; unknown is not lagging.

A stand-in can also fall behind with its clock on time: when its HTTP side cannot keep up (starved of CPU, or
relaying more streams than its one event loop can), requests wait outside its engine, the engine idles - which
counts as on time - and it serves fewer requests than the bench keeps open. So each pass also reads the requests
its engine held over wall time (`held_request_s`, `wall_s`): held over concurrency x wall seconds is the
`held_ratio`, and the stand-in's measured curve turns it into the share of its schedule it delivered
(`schedule_share`: its throughput at the concurrency it held over its throughput at the level's, interpolated
as the crossover is). What a pair's verdict can be wrong by is one stand-in's share against the other's: the
HTTP exchange's own cost is shared (measured on a quiet machine at time scale 20 with 32 output tokens: both
held 0.82-0.93 at every level, shares within 4 % of each other), while a stand-in whose HTTP side lags alone
held 0.38 (pinned beside a burner at the lowest priority). A pass where a stand-in's share is below
LAGGING_SPEED_RATIO of the best share among the pass's stand-ins counts as lagging, as a slow clock does. A
stand-in alone, or beside a real server or a gateway, has no share to be held to - the exchange's own cost is
0.83-0.87 at C=1 with 32-token answers at time scale 20, and more through a gateway - so only its clock judges it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from crossover.loadtest.crossover import interpolate
from crossover.loadtest.models import LevelSchedule, Schedule, Simulation, TargetInfo
from crossover.servers.sim.schedule import LAGGING_SPEED_RATIO


def _number(value: Any) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def read_schedule(raw: Any) -> Schedule | None:
    """The `schedule` block of /server_info; None if there is none."""
    if not isinstance(raw, dict):
        return None
    lagging = raw.get("lagging")
    return Schedule(
        time_scale=_number(raw.get("time_scale")),
        lag_s=_number(raw.get("lag_s")),
        max_lag_s=_number(raw.get("max_lag_s")),
        speed_ratio=_number(raw.get("speed_ratio")),
        lagging=lagging if isinstance(lagging, bool) else None,
    )


def read_simulation(info: Any) -> Simulation | None:
    """A target's Simulation record if its /server_info says `"simulated": true`, else None."""
    if not isinstance(info, dict) or info.get("simulated") is not True:
        return None
    schedule = read_schedule(info.get("schedule"))
    simulator = info.get("simulator") if isinstance(info.get("simulator"), dict) else {}
    time_scale = schedule.time_scale if schedule is not None else None
    if time_scale is None:
        time_scale = _number(simulator.get("time_scale"))
    return Simulation(time_scale=time_scale, schedule=schedule)


def _schedule_number(info: Any, key: str) -> float | None:
    schedule = info.get("schedule") if isinstance(info, dict) else None
    return _number(schedule.get(key)) if isinstance(schedule, dict) else None


def level_speed_ratio(before: Any, after: Any, wall_s: float, time_scale: float | None) -> float | None:
    """Profile seconds the stand-in advanced between two /server_info reads / (wall seconds x time scale)."""
    start, end = _schedule_number(before, "clock_s"), _schedule_number(after, "clock_s")
    if start is None or end is None or time_scale is None or wall_s <= 0:
        return None
    return (end - start) / (wall_s * time_scale)


def held_ratio(before: Any, after: Any, concurrency: int) -> float | None:
    """Request-seconds the stand-in's engine held between two /server_info reads / (concurrency x its wall
    seconds between them)."""
    held_then, wall_then, held_now, wall_now = (
        _schedule_number(info, key) for info in (before, after) for key in ("held_request_s", "wall_s")
    )
    if held_then is None or wall_then is None or held_now is None or wall_now is None or wall_now <= wall_then:
        return None
    return (held_now - held_then) / (concurrency * (wall_now - wall_then))


def read_pass(
    simulation: Simulation,
    concurrency: int,
    info: Any,
    before: Any = None,
    wall_s: float = 0.0,
    index: int | None = None,
) -> LevelSchedule:
    """What /server_info said right after a pass of a level (None: it did not answer), with the read from right
    before it (`before`, `wall_s` apart) deciding whether the stand-in fell behind during it. Updates what
    `simulation` last heard; appending the entry is the caller's (a pass measured again is marked first)."""
    schedule = read_schedule(info.get("schedule")) if isinstance(info, dict) else None
    entry = LevelSchedule(concurrency=concurrency, **(schedule.model_dump() if schedule else {}))
    if schedule is not None:
        simulation.schedule = schedule
        if schedule.time_scale is not None:
            simulation.time_scale = schedule.time_scale
    ratio = level_speed_ratio(before, info, wall_s, simulation.time_scale)
    if ratio is not None:
        # The stand-in's own clock over exactly this pass decides: the tokens it delivered follow that clock. Its
        # `lagging` flag judges its last few seconds (the other target's pass among them) and stays on until it
        # has kept up for a whole window, so it would condemn passes it ran on time.
        entry.level_speed_ratio = round(ratio, 4)
        entry.lagging = ratio < LAGGING_SPEED_RATIO
    held = held_ratio(before, info, concurrency)
    if held is not None:
        entry.held_ratio = round(held, 4)
    return entry


def schedule_share(held: float, concurrency: int, throughput: float, below: Mapping[int, float]) -> float | None:
    """The share of its throughput at `concurrency` a target delivered while holding `held` x that many
    requests: its curve (the levels `below` it, and this pass's `throughput` at it) read at the concurrency it
    held. None without a throughput to read."""
    if throughput <= 0:
        return None
    curve = {c: value for c, value in below.items() if c < concurrency and value > 0}
    curve[concurrency] = throughput
    return round(min(1.0, interpolate(curve, min(1.0, held) * concurrency) / throughput), 4)


def judge_shares(entries: Mapping[str, LevelSchedule]) -> None:
    """Mark lagging each pass whose stand-in's `schedule_share` is below LAGGING_SPEED_RATIO of the best among
    `entries` (one pass of a level, per stand-in); nothing where fewer than two have one."""
    shares = {name: entry.schedule_share for name, entry in entries.items() if entry.schedule_share is not None}
    if len(shares) < 2:
        return
    best = max(shares.values())
    for name, share in shares.items():
        if share < LAGGING_SPEED_RATIO * best:
            entries[name].lagging = True


def record_level(
    simulation: Simulation, concurrency: int, info: Any, before: Any = None, wall_s: float = 0.0
) -> LevelSchedule:
    """`read_pass`, appended to `simulation` (a level measured in one pass)."""
    entry = read_pass(simulation, concurrency, info, before, wall_s)
    simulation.levels.append(entry)
    return entry


def describe_lag(entry: Schedule) -> str:
    """`lag 2.3 s, speed 0.55 x` from what is known."""
    parts = []
    if isinstance(entry, LevelSchedule) and entry.level_speed_ratio is not None:
        parts.append(f"speed {entry.level_speed_ratio:.2f} x its time scale over the level")
    if isinstance(entry, LevelSchedule) and entry.held_ratio is not None:
        share = "" if entry.schedule_share is None else f", {entry.schedule_share:.2f} of its schedule delivered"
        parts.append(f"its engine held {entry.held_ratio:.2f} of the {entry.concurrency} requests kept open{share}")
    if entry.lag_s is not None:
        parts.append(f"lag {entry.lag_s:.2f} s")
    if entry.speed_ratio is not None:
        parts.append(f"speed {entry.speed_ratio:.2f} x its time scale")
    return ", ".join(parts) or "no figures given"


def refusal(targets: Mapping[str, TargetInfo], speculative: str, plain: str) -> str | None:
    """Why no crossover may be named between the pair (a stand-in of it lagged during a level), or None."""
    reasons = []
    for name in (speculative, plain):
        info = targets.get(name)
        simulation = info.simulation if info is not None else None
        if simulation is None:
            continue
        lagging = [entry for entry in simulation.levels if entry.lagging and not entry.rerun]
        if not lagging:
            continue
        scale = f" at time scale {simulation.time_scale:g}" if simulation.time_scale is not None else ""
        levels = ", ".join(str(entry.concurrency) for entry in lagging)
        worst = max(lagging, key=lambda entry: entry.lag_s or 0.0)
        reasons.append(f"{name} (a stand-in{scale}) fell behind its schedule at C = {levels} ({describe_lag(worst)})")
    if not reasons:
        return None
    return (
        "; ".join(reasons)
        + ": its throughput there is this machine's, not its profile's. Re-run with a lower --time-scale, "
        "fewer or lower levels, or more CPU for the stand-ins."
    )
