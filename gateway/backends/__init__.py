"""The pools' backends: in-flight leases, load signals, the least-loaded choice, whether each may take traffic
(the breaker, its probes, its load and acceptance scrapes), and the live rate table of what each pool delivered."""

from __future__ import annotations

from crossover.gateway.backends.health import Breaker, HealthMonitor
from crossover.gateway.backends.pools import Backend, Lease, Pools
from crossover.gateway.backends.rates import LEVEL_NAMES, PROMPT_NAMES, RateTable, level_bounds, prompt_bucket

__all__ = [
    "LEVEL_NAMES",
    "PROMPT_NAMES",
    "Backend",
    "Breaker",
    "HealthMonitor",
    "Lease",
    "Pools",
    "RateTable",
    "level_bounds",
    "prompt_bucket",
]
