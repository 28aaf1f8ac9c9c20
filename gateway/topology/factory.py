"""`make_topology`: the topology the settings name, built whole with what it needs of the gateway's state."""

from __future__ import annotations

import httpx

from crossover.gateway.admission import Admission
from crossover.gateway.backends import Breaker, Pools
from crossover.gateway.cluster import Worker, make_coordination
from crossover.gateway.config import Settings
from crossover.gateway.metrics import Metrics
from crossover.gateway.topology.gates import GateSync
from crossover.gateway.topology.in_engine import InEngine
from crossover.gateway.topology.interface import Topology
from crossover.gateway.topology.partitioned import Partitioned
from crossover.gateway.topology.routing import Routing
from crossover.gateway.topology.switching import SwitchController
from crossover.gateway.topology.time_shared import TimeShared
from crossover.gateway.tracing import Tracing


def make_topology(
    settings: Settings,
    pools: Pools,
    routing: Routing,
    metrics: Metrics,
    breaker: Breaker,
    admission: Admission,
    client: httpx.AsyncClient,
    worker: Worker | None = None,
    tracing: Tracing | None = None,
) -> Topology:
    """The topology `settings` names, built whole with what it needs of the gateway's state (and its cluster's: one
    of a host's workers is a member of its host's)."""
    coordination = make_coordination(settings, pools, worker)
    if settings.topology == "time-shared":
        controller = SwitchController(
            settings,
            pools,
            routing,
            metrics,
            breaker,
            client,
            coordination=coordination,
            queued_elsewhere=lambda: admission.queued,
            tracing=tracing,
        )
        return TimeShared(pools, routing, metrics, coordination, controller)
    if settings.topology == "in-engine":
        spec = settings.pools.speculative
        gates = GateSync(
            pools,
            routing,
            client,
            settings.health.timeout,
            settings.health.interval,
            spec.control_key,
            coordination=coordination,
            tracing=tracing,
        )
        return InEngine(pools, routing, metrics, coordination, gates)
    return Partitioned(pools, routing, metrics, coordination)
