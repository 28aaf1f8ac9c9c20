"""Everything one gateway instance holds at run time, built once by `create_app` and passed around."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import httpx

from crossover.gateway.admission import Admission
from crossover.gateway.config import Settings
from crossover.gateway.metrics import Metrics
from crossover.gateway.pools import Pools
from crossover.gateway.routing import Routing

if TYPE_CHECKING:
    from crossover.gateway.switching import SwitchController


@dataclass
class GatewayState:
    settings: Settings
    pools: Pools
    routing: Routing
    metrics: Metrics
    admission: Admission
    # Per-operation socket timeouts for backend requests (httpx's `extensions["timeout"]`).
    request_timeout: dict[str, float]
    started_at: float = field(default_factory=time.time)
    # Made in the app's lifespan (they must live on the serving event loop), closed when it ends: the
    # transport carries generation requests, the client (over the same transport) health checks.
    transport: httpx.AsyncBaseTransport | None = None
    client: httpx.AsyncClient | None = None
    # The switch controller of a time-shared GPU set (topology = "time-shared"), else None.
    switching: SwitchController | None = None

    def snapshot(self) -> dict:
        return {
            **self.routing.state(),
            "load_signal": self.pools.load_signal,
            "inflight": self.admission.active,
            "queued": self.admission.queued,
            "models": sorted(self.pools.model_names()),
            "pools": self.pools.state(),
        }
