"""The pure decisions: which pool a request goes to (route.py), and when a time-shared GPU set switches
(switcher.py). Plain data in, a decision out, the clock injected: the live gateway and `crossover sim replay` run
the same code."""

from __future__ import annotations

from crossover.gateway.policies.route import (
    FALLBACK,
    FLEX,
    FLEX_TIER,
    IN_ENGINE,
    POLICIES,
    PRIORITY,
    PRIORITY_TIER,
    TIERS,
    Decision,
    Loads,
    PolicyName,
    RoutePolicy,
    Tier,
    for_tier,
    least_loaded,
    spillover,
    switch,
)
from crossover.gateway.policies.switcher import (
    DEFAULT_ADVANTAGE,
    DEFAULT_MIN_DWELL_S,
    DEFAULT_PRIOR_PHASE_S,
    DEFAULT_WINDOW_S,
    PolicySettings,
    SwitchCost,
    SwitchDecision,
    Switcher,
    ThresholdRates,
)

__all__ = [
    "DEFAULT_ADVANTAGE",
    "DEFAULT_MIN_DWELL_S",
    "DEFAULT_PRIOR_PHASE_S",
    "DEFAULT_WINDOW_S",
    "FALLBACK",
    "FLEX",
    "FLEX_TIER",
    "IN_ENGINE",
    "POLICIES",
    "PRIORITY",
    "PRIORITY_TIER",
    "TIERS",
    "Decision",
    "Loads",
    "PolicyName",
    "PolicySettings",
    "RoutePolicy",
    "SwitchCost",
    "SwitchDecision",
    "Switcher",
    "ThresholdRates",
    "Tier",
    "for_tier",
    "least_loaded",
    "spillover",
    "switch",
]
