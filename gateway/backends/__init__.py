"""The pools' backends: in-flight leases, load signals, the least-loaded choice, and whether each may take
traffic (the breaker, its probes and load scrapes)."""

from __future__ import annotations

from crossover.gateway.backends.health import Breaker, HealthMonitor
from crossover.gateway.backends.pools import Backend, Lease, Pools

__all__ = ["Backend", "Breaker", "HealthMonitor", "Lease", "Pools"]
