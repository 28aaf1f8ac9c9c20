"""In-engine: one pool of patched EAGLE-3 servers whose zero-step gate is the threshold; a mode forces every gate."""

from __future__ import annotations

from crossover.gateway.backends import Pools
from crossover.gateway.cluster import Control, Coordination
from crossover.gateway.config import SPECULATIVE
from crossover.gateway.errors import BackendFailed, InvalidRequest, NotForTopology
from crossover.gateway.metrics import Metrics
from crossover.gateway.modes import Mode
from crossover.gateway.policies import IN_ENGINE
from crossover.gateway.topology.collectors import GateCollector, SwitchCollector
from crossover.gateway.topology.gates import GateRefused, GateSync
from crossover.gateway.topology.interface import THRESHOLD, ModeLease, Topology
from crossover.gateway.topology.routing import Routing


class InEngine(Topology):
    """One pool of patched EAGLE-3 servers whose zero-step gate is the threshold (gateway/topology/gates.py)."""

    name = "in-engine"
    direct_lane = True
    other_pool = True  # (its plain pool is empty)
    no_policy = "has one pool, whose engines' zero-step gate is the threshold"

    def __init__(
        self, pools: Pools, routing: Routing, metrics: Metrics, coordination: Coordination, gates: GateSync
    ) -> None:
        super().__init__(pools, routing, metrics, coordination)
        self.gates = gates
        metrics.registry.register(SwitchCollector())
        metrics.registry.register(GateCollector(gates))

    async def start(self) -> None:
        await super().start()
        await self.gates.start()  # NotPatched: refuse to serve, naming the patch

    async def stop(self) -> None:
        await self.gates.stop()
        await super().stop()

    def control(self) -> Control:
        return super().control().model_copy(update={"forced_mode": self.gates.forced, "pinned": self.gates.pinned})

    async def apply_control(self, control: Control) -> None:
        """Another replica's threshold or mode: the leader writes it to every engine, a follower reads it back."""
        await super().apply_control(control)
        await self.gates.follow(control.forced_mode, control.pinned)

    def route(self, lease: ModeLease | None, tier: str | None = None) -> tuple[str, str]:
        # One pool: whether a request is speculated is the engines' gate, which sees no tier.
        return SPECULATIVE, IN_ENGINE

    async def threshold_changed(self, fields: set[str]) -> None:
        if THRESHOLD not in fields:
            return  # hysteresis alone moves no gate (and ends no forced mode)
        try:
            failed = await self.gates.threshold_changed()
        except GateRefused as exc:
            raise InvalidRequest(str(exc), param=THRESHOLD, code="gate_refused") from None
        if failed:
            raise BackendFailed(
                "the threshold is live, but these backends' gates are not yet (each serves on the gate it has, "
                "held out only where that is none; retried every health interval): " + "; ".join(failed)
            )

    def threshold_view(self) -> dict:
        return self.gates.view()  # the threshold as each engine's gate, read back

    def state_view(self, snapshot: dict) -> dict:
        snapshot.update(self.gates.view())
        return snapshot

    def mode_view(self) -> dict:
        return self.gates.view()

    async def set_mode(self, mode: Mode | None, pin: bool | None) -> tuple[dict, int]:
        """The mode is every engine's gate (plain: 0, speculative: none) until the next threshold change, or pinned
        until `{"pin": false}`."""
        if pin and mode is None and self.gates.forced is None:
            raise NotForTopology(
                'no mode is forced, so there is none to pin: send the mode with it ({"mode": ..., "pin": true})',
                param="pin",
                code="nothing_to_pin",
            )
        try:
            failed = await self.gates.force(mode, pin=pin)
        except GateRefused as exc:
            raise InvalidRequest(str(exc), param="mode", code="gate_refused") from None
        if failed:
            raise BackendFailed("the mode is live, but these backends' gates are not: " + "; ".join(failed))
        return self.gates.view(), 200
