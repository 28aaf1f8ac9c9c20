"""Partitioned pools: both modes serve at once, each from its own servers; the routing policy picks per request."""

from __future__ import annotations

from crossover.gateway.backends import Pools
from crossover.gateway.cluster import Coordination
from crossover.gateway.errors import NotForTopology
from crossover.gateway.metrics import Metrics
from crossover.gateway.modes import Mode
from crossover.gateway.topology.collectors import SwitchCollector
from crossover.gateway.topology.interface import ModeLease, Topology
from crossover.gateway.topology.routing import Routing


class Partitioned(Topology):
    """Both pools serve at once; the routing policy (spillover or switch) picks one per request."""

    name = "partitioned"
    direct_lane = True
    other_pool = True
    no_policy = None

    def __init__(self, pools: Pools, routing: Routing, metrics: Metrics, coordination: Coordination) -> None:
        super().__init__(pools, routing, metrics, coordination)
        # Every topology exposes the switch families (none serves a mode here), so dashboards need no topology.
        metrics.registry.register(SwitchCollector())

    def route(self, lease: ModeLease | None, tier: str | None = None) -> tuple[str, str]:
        decision = self.routing.decide(self.pools, tier)
        return decision.pool, decision.reason

    def mode_view(self) -> dict:
        raise self._no_mode()

    async def set_mode(self, mode: Mode | None, pin: bool | None) -> tuple[dict, int]:
        raise self._no_mode()

    def _no_mode(self) -> NotForTopology:
        return NotForTopology(
            "topology 'partitioned' serves both modes at once, each from its own pool: there is no mode to switch "
            "or pin (move the threshold instead: PUT /admin/threshold)",
            code="no_mode_to_switch",
        )
