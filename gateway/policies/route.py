"""Routing policies: pure functions of the load, no I/O and no hidden state.

    spillover(speculative_load=10, threshold=32)              -> Decision("speculative", "below_threshold")
    spillover(speculative_load=20, threshold=1, total_load=63, share=0.5)
                                                              -> Decision("speculative", "below_share")
    switch(total_load=40, threshold=32, hysteresis=4, current="speculative")
                                                              -> Decision("plain", "above_threshold")
    for_tier(Decision("plain", "above_threshold"), "priority", speculative_load=40, priority_headroom=64,
             plain_usable=True)                               -> Decision("speculative", "priority_tier")

Loads count requests in flight *before* the one being routed, so with threshold T the first T
concurrent requests go to the speculative pool and request T + 1 goes to the plain pool.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, get_args

from crossover.gateway.modes import PLAIN, SPECULATIVE

# The policies a partitioned gateway may route by ([routing] policy, PUT /admin/threshold's `policy`).
PolicyName = Literal["switch", "spillover"]

BELOW = "below_threshold"
ABOVE = "above_threshold"
# Spillover: the speculative pool is above the threshold but below its share of the load (`spillover`).
BELOW_SHARE = "below_share"
HYSTERESIS = "hysteresis"
# A request's OpenAI `service_tier` moved it from the pool the load chose (`for_tier`).
PRIORITY_TIER = "priority_tier"
FLEX_TIER = "flex_tier"
# The chosen pool had no usable backend, so the other pool took the request.
FALLBACK = "fallback"
# Topology 'in-engine': one pool; speculation is the engines' gate (gateway/topology/gates.py).
IN_ENGINE = "in_engine"


# OpenAI's `service_tier`. Speculation is a latency tool: `priority` may take the speculative pool above the
# threshold (up to the priority headroom), `flex` (batch work) never takes a speculative slot while plain can serve;
# `auto` and `default` route as a request without a tier does.
Tier = Literal["auto", "default", "flex", "priority"]
TIERS: tuple[Tier, ...] = get_args(Tier)
PRIORITY: Tier = "priority"
FLEX: Tier = "flex"


@dataclass(frozen=True, slots=True)
class Decision:
    pool: str
    reason: str


# The decisions, made once: one is asked for per request.
_SPECULATIVE_BELOW = Decision(SPECULATIVE, BELOW)
_SPECULATIVE_SHARE = Decision(SPECULATIVE, BELOW_SHARE)
_PLAIN_ABOVE = Decision(PLAIN, ABOVE)
_PLAIN_HYSTERESIS = Decision(PLAIN, HYSTERESIS)
_SPECULATIVE_PRIORITY = Decision(SPECULATIVE, PRIORITY_TIER)
_PLAIN_FLEX = Decision(PLAIN, FLEX_TIER)


def spillover(speculative_load: int, threshold: int, total_load: int = 0, share: float = 0.0) -> Decision:
    """Partitioned pools: the speculative pool takes requests while *its* load is below the threshold, or below
    `share` of every request in flight with this one (`total_load` + 1).

    The share is the speculative servers' own capacity. With the threshold alone they hold T requests however
    many arrive, and at high load a pair of servers on disjoint GPUs then leaves the speculative one nearly idle:
    from real vLLM's curves (CPU, one core each) the best split at 64 streams puts 16 on the speculative server,
    and the best T alone serves 64 at 85 % of that split (loadtest/crossover.py fits both).
    """
    if speculative_load < threshold:
        return _SPECULATIVE_BELOW
    return _SPECULATIVE_SHARE if speculative_load < share * (total_load + 1) else _PLAIN_ABOVE


def switch(total_load: int, threshold: int, hysteresis: int, current: str) -> Decision:
    """One side at a time: plain from `threshold` up; back to speculative only below `threshold - hysteresis`.

    `current` is the side the previous decision chose; the band below the threshold keeps it, so a
    load hovering around the threshold does not flap between the pools.
    """
    if total_load >= threshold:
        return _PLAIN_ABOVE
    if current == PLAIN and total_load >= threshold - hysteresis:
        return _PLAIN_HYSTERESIS
    return _SPECULATIVE_BELOW


def for_tier(
    decision: Decision, tier: str | None, speculative_load: int, priority_headroom: int, plain_usable: bool
) -> Decision:
    """The load's `decision`, moved by the request's service tier: `priority` to the speculative pool while that
    pool's load is below `priority_headroom` (whatever the threshold says); `flex` to the plain pool whenever it has
    a usable backend. Any other tier, or none, keeps the decision: a tier never does worse than no tier."""
    if tier == PRIORITY:
        if decision.pool == PLAIN and speculative_load < priority_headroom:
            return _SPECULATIVE_PRIORITY
    elif tier == FLEX and decision.pool == SPECULATIVE and plain_usable:
        return _PLAIN_FLEX
    return decision


def least_loaded(loads: Sequence[int], start: int = 0) -> int | None:
    """Index of the smallest load; ties go to the first at or after `start` (so callers can rotate)."""
    count = len(loads)
    best: int | None = None
    for offset in range(count):
        index = (start + offset) % count
        if best is None or loads[index] < loads[best]:
            best = index
    return best


class Loads(Protocol):
    """What a policy may read of the pools' load (gateway/backends/pools.py's `Pools`): read only as it needs."""

    def pool_load(self, pool: str) -> int: ...

    def total_load(self) -> int: ...


# A policy by name: (loads, threshold, hysteresis, spillover share, the side the previous decision chose) -> the
# decision.
RoutePolicy = Callable[[Loads, int, int, float, str], Decision]


def _spillover(loads: Loads, threshold: int, hysteresis: int, share: float, current: str) -> Decision:
    speculative = loads.pool_load(SPECULATIVE)
    if speculative < threshold or not share:  # the total only where the share can need it
        return spillover(speculative, threshold)
    return spillover(speculative, threshold, loads.total_load(), share)


POLICIES: dict[PolicyName, RoutePolicy] = {
    "switch": lambda loads, threshold, hysteresis, share, current: switch(
        loads.total_load(), threshold, hysteresis, current
    ),
    "spillover": _spillover,
}
