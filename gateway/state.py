"""Everything one gateway instance holds at run time, built once by `create_app`: what the admin API and
the app's own endpoints read. The request path takes only the parts it uses (gateway/request/proxy.py)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import httpx

from crossover.gateway.admission import Admission
from crossover.gateway.backends import Breaker, HealthMonitor, Pools
from crossover.gateway.cluster import Worker
from crossover.gateway.config import Settings
from crossover.gateway.metrics import Metrics
from crossover.gateway.request import Failover
from crossover.gateway.topology import AdaptiveController, Routing, Topology


@dataclass
class GatewayState:
    settings: Settings
    pools: Pools
    routing: Routing
    metrics: Metrics
    admission: Admission
    breaker: Breaker
    failover: Failover
    monitor: HealthMonitor
    # Over the transport that carries generation requests: health checks, load scrapes and the topology's calls.
    # Its connections open on the serving loop; the app's lifespan closes it.
    client: httpx.AsyncClient
    topology: Topology
    # Moves the threshold toward the crossover at the live acceptance ([adaptive]); idle unless enabled.
    adaptive: AdaptiveController
    started_at: float = field(default_factory=time.time)
    # Set at SIGTERM: /health answers 503 so load balancers stop sending before connections close.
    draining: bool = False
    # One of `crossover serve --workers N` (gateway/cluster/host.py); None: the gateway is this process.
    worker: Worker | None = None

    def snapshot(self) -> dict:
        """/admin/state, as the topology sees it."""
        inflight, queued = self.admission.active, self.admission.queued
        if self.worker is not None:
            inflight, queued = self.worker.admitted(self.admission)
        snapshot = {
            **self.routing.state(),
            "load_signal": self.pools.load_signal,
            "inflight": inflight,
            "queued": queued,
            "models": sorted(self.pools.model_names()),
            "pools": self.pools.state(),
            "topology": self.topology.name,
            "adaptive": self.adaptive.view(),
            **self.topology.coordination.view(),
        }
        if self.worker is not None:
            snapshot["worker"] = {"slot": self.worker.slot, "workers": self.worker.host.workers, "pid": os.getpid()}
        return self.topology.state_view(snapshot)
