"""Time-shared: one GPU set serves one mode at a time, switched by its controller; a follower carries an operator's
PUT /admin/mode to the leader (the answer shared for /admin/state on every replica: switching/replicas.py)."""

from __future__ import annotations

from collections.abc import Callable

from crossover.gateway.backends import Pools
from crossover.gateway.cluster import Control, Coordination
from crossover.gateway.errors import BackendBusy, GatewayError, StateNotShared
from crossover.gateway.metrics import Metrics
from crossover.gateway.modes import Mode
from crossover.gateway.topology.collectors import SwitchCollector
from crossover.gateway.topology.interface import ModeLease, Topology
from crossover.gateway.topology.routing import Routing
from crossover.gateway.topology.switching import ACTIVE_MODE, ModeRequests, SwitchController


class TimeShared(Topology):
    """One GPU set, one mode at a time: the switch controller (gateway/topology/switching/controller.py) owns which."""

    name = "time-shared"
    direct_lane = False  # a request may have to wait for a switch
    other_pool = False  # the other mode's server is asleep or stopped
    no_policy = "serves one mode at a time, and its switch controller decides when to switch"

    def __init__(
        self, pools: Pools, routing: Routing, metrics: Metrics, coordination: Coordination, controller: SwitchController
    ) -> None:
        super().__init__(pools, routing, metrics, coordination)
        self.controller = controller
        self.requests = ModeRequests(controller, coordination)  # PUT /admin/mode, carried to the leader
        controller.after_adoption = self.requests.adopted
        metrics.registry.register(SwitchCollector(lambda: (controller.serving, controller.queued)))

    async def start(self) -> None:
        await super().start()
        await self.controller.start()

    async def stop(self) -> None:
        await self.controller.stop()
        await super().stop()

    def control(self) -> Control:
        controller = self.controller
        published = {
            "pinned": controller.pinned,
            "mode": controller.mode,
            "phase": str(controller.phase),
            "target": controller.target,
            **self.requests.published(),
        }
        return super().control().model_copy(update=published)

    async def apply_control(self, control: Control) -> None:
        """The leader runs a follower's PUT /admin/mode and publishes its answer; a follower mirrors the leader's
        mode, phase and pin (and its operator changes: the rate limit holds on every replica alike)."""
        await super().apply_control(control)
        self.requests.apply(control)
        if not self.coordination.leader:
            self.controller.mirror(control.mode, control.phase, control.target, control.pinned)

    async def admit(self, on_cut: Callable[[str], None]) -> ModeLease:
        # During a switch this waits in the switch queue (bounded in length and time).
        lease = await self.controller.admit()
        lease.on_cut(on_cut)
        return lease

    def route(self, lease: ModeLease | None, tier: str | None = None) -> tuple[str, str]:
        # One mode serves: a tier cannot choose a pool here (only admission orders tiers).
        return lease.mode, ACTIVE_MODE

    def trace_view(self) -> dict[str, str | int | None]:
        controller = self.controller
        return {**super().trace_view(), "mode": controller.mode, "phase": str(controller.phase)}

    def open_failed(self, pool: str, error: GatewayError) -> GatewayError:
        if isinstance(error, BackendBusy):
            return error  # SGLang's queue-full (or a 503/429): the server is up and full - busy, retry shortly
        # Its one server failed it (dead, say): a 503 that says the GPU set is on it, with Retry-After.
        return self.controller.serving_failed(pool)

    def state_view(self, snapshot: dict) -> dict:
        controller = self.controller
        # One GPU set serves everything: no routing policy applies, whatever [routing] says.
        snapshot["policy"] = "time-shared"
        # A request held by the switch queue holds an admission slot too: count it once, as queued.
        snapshot["inflight"] -= controller.queued
        snapshot["queued"] += controller.queued
        snapshot.update(controller.view())
        snapshot["mode_request"] = self.requests.view()
        return snapshot

    def mode_view(self) -> dict:
        return self.controller.view()

    async def set_mode(self, mode: Mode | None, pin: bool | None) -> tuple[dict, int]:
        """202 while the switch runs, 200 if the mode already serves (or only the pin changed). A replica that does
        not hold the lease refuses what the leader would refuse, as far as the leader's published phase tells it
        (409 mid-switch, 429 too soon), and carries the rest to the leader (`share`, which follows): 202, with the
        request's id that /admin/state answers under (`mode_request`)."""
        if mode is not None and not self.coordination.connected:
            # The other replicas would not see the switch's phase, and route to the old mode meanwhile.
            raise StateNotShared("no switch starts while the cluster's store is unreachable; the mode is unchanged")
        return self.requests.put(mode, pin)
