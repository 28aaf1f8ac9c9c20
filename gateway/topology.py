"""The deployment's shape behind one interface: partitioned pools, a time-shared GPU set, or in-engine gates.

    topology = make_topology(settings, pools, routing, metrics, breaker, admission, client)   # build_state
    await topology.start() ... await topology.stop()       # the app's lifespan (and the cluster's membership)
    lease = await topology.admit(on_cut)                    # a request: its place on the mode that serves (or None)
    pool, reason = topology.route(lease)                    # ... and the pool it goes to
    topology.direct_lane                                    # may the direct lane take a request here?
    await topology.set_mode("plain", pin=True)              # PUT /admin/mode: (view, status), or NotForTopology
    await topology.share()                                  # after either PUT: live on every replica

With replicas (gateway/coordination.py), the threshold, hysteresis, policy, mode and pin are the cluster's: a
topology says what of its state is shared (`control`) and takes what another replica changed (`apply_control`);
only the replica holding the lease acts on the GPU set (time-shared: switches; in-engine: writes the gates).

What the routing asks, what the admin API's threshold, mode and pin mean, the state view, the metrics it adds, its
start-up and shutdown: each topology answers for itself, so the app, the admin API and the request path ask the
topology and never which one it is. What a topology cannot honour it refuses with a 409 that says why
(`NotForTopology`), never a 200 with nothing done.

- partitioned: the routing policy picks a pool per request; threshold, hysteresis and policy are its; a mode or a
  pin is refused (both modes serve at once).
- time-shared: every request goes to the mode that serves (held during a switch); threshold and hysteresis are the
  switch policy's, a routing policy is refused; a mode switches now, a pin keeps the policy off it.
- in-engine: one pool; the threshold is every engine's gate (hysteresis is kept and moves nothing), a routing
  policy is refused; a mode forces every gate until the next threshold change, pinned until `{"pin": false}`; a gate
  the engines refuse is a 400 `gate_refused` with their reason, and the previous gate stays live.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable

import httpx

from crossover.gateway.admission import Admission
from crossover.gateway.config import SPECULATIVE, Settings, ThresholdError
from crossover.gateway.coordination import (
    Control,
    Coordination,
    ModeAnswer,
    ModeRequest,
    StoreUnavailable,
    make_coordination,
)
from crossover.gateway.errors import (
    BackendBusy,
    BackendFailed,
    GatewayError,
    InvalidRequest,
    NotForTopology,
    StateNotShared,
)
from crossover.gateway.health import Breaker
from crossover.gateway.host import Worker
from crossover.gateway.in_engine import GateRefused, GateSync
from crossover.gateway.metrics import ClusterCollector, GateCollector, Metrics, SwitchCollector
from crossover.gateway.modes import Mode
from crossover.gateway.policy import IN_ENGINE
from crossover.gateway.pools import Pools
from crossover.gateway.routing import Routing
from crossover.gateway.switching import ACTIVE_MODE, Lease, SwitchController

log = logging.getLogger("crossover.topology")

# What a PUT /admin/threshold may name (gateway/admin.py's ThresholdUpdate).
THRESHOLD, HYSTERESIS, POLICY = "threshold", "hysteresis", "policy"


class Topology:
    """The interface, and what the partitioned topology does (the others say where they differ)."""

    name = "partitioned"
    # Whether the direct lane (gateway/direct.py) may take a request: it waits on nothing, so not where a request
    # may have to wait for a mode.
    direct_lane = True
    # Whether a request its pool cannot serve may go to the other pool.
    other_pool = True
    # Why a routing policy (PUT /admin/threshold's `policy`) means nothing here; None: it is this topology's.
    no_policy: str | None = None

    def __init__(self, pools: Pools, routing: Routing, metrics: Metrics, coordination: Coordination) -> None:
        self.pools = pools
        self.routing = routing
        self.coordination = coordination
        # Every topology exposes the switch families (none serves a mode here), so dashboards need no topology.
        metrics.registry.register(SwitchCollector())
        metrics.registry.register(ClusterCollector(coordination))

    # -- lifespan -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Once the first health round is in, before serving; what it raises refuses to serve."""
        await self.coordination.start(self.control, self.apply_control)  # the cluster's state first

    async def stop(self) -> None:
        """At shutdown; safe after a `start` that raised."""
        await self.coordination.stop()

    # -- the cluster ----------------------------------------------------------------------------

    def control(self) -> Control:
        """What of this replica's state every replica shares."""
        routing = self.routing
        return Control(threshold=routing.threshold, hysteresis=routing.hysteresis, policy=routing.policy)

    async def apply_control(self, control: Control) -> None:
        """What another replica changed; never raises (a bad value is logged and the old one serves)."""
        try:
            self.routing.update(control.threshold, control.hysteresis, control.policy)
        except ThresholdError as exc:
            log.error("the cluster's control state does not apply here (%s): keeping the live one", exc)
        except OSError:
            pass  # live, not saved: Routing said so (state_file_problem)

    async def share(self) -> None:
        """After a PUT: the change is written for every replica now (503 if it could not be: live here only, and
        written for the others when the cluster's store answers again)."""
        try:
            await self.coordination.share()
        except StoreUnavailable as exc:
            raise StateNotShared(
                f"the change is live on this replica, and reaches the others once the cluster's store answers ({exc})"
            ) from None

    # -- the request path -----------------------------------------------------------------------

    async def admit(self, on_cut: Callable[[str], None]) -> Lease | None:
        """The request's place on the mode that serves it (`on_cut(reason)` ends it early); None: nothing to hold."""
        return None

    def route(self, lease: Lease | None) -> tuple[str, str]:
        """(pool, reason) for a new request."""
        decision = self.routing.decide(self.pools)
        return decision.pool, decision.reason

    def open_failed(self, pool: str, error: GatewayError) -> GatewayError:
        """What the client gets when no backend of `pool` (and, where allowed, of the other) opened a response."""
        return error

    # -- the admin API --------------------------------------------------------------------------

    def check_threshold_update(self, fields: set[str]) -> None:
        """Before PUT /admin/threshold applies `fields`: NotForTopology for what means nothing here."""
        if POLICY in fields and self.no_policy is not None:
            raise NotForTopology(
                f"topology {self.name!r} {self.no_policy}: no routing policy applies",
                param=POLICY,
                code="no_routing_policy",
            )

    async def threshold_changed(self, fields: set[str]) -> None:
        """After PUT /admin/threshold applied `fields`; BackendFailed if the backends did not all follow."""

    def threshold_view(self) -> dict:
        """What GET/PUT /admin/threshold adds to the routing state."""
        return {}

    def state_view(self, snapshot: dict) -> dict:
        """/admin/state: the gateway's snapshot as this topology sees it."""
        return snapshot

    def mode_view(self) -> dict:
        """GET /admin/mode."""
        raise self._no_mode()

    async def set_mode(self, mode: Mode | None, pin: bool | None) -> tuple[dict, int]:
        """PUT /admin/mode: (the view after it, the HTTP status)."""
        raise self._no_mode()

    def _no_mode(self) -> NotForTopology:
        return NotForTopology(
            "topology 'partitioned' serves both modes at once, each from its own pool: there is no mode to switch "
            "or pin (move the threshold instead: PUT /admin/threshold)",
            code="no_mode_to_switch",
        )


class Partitioned(Topology):
    """Both pools serve at once; the routing policy (spillover or switch) picks one per request."""


class TimeShared(Topology):
    """One GPU set, one mode at a time: the switch controller (gateway/switching.py) owns which."""

    name = "time-shared"
    direct_lane = False  # a request may have to wait for a switch
    other_pool = False  # the other mode's server is asleep or stopped
    no_policy = "serves one mode at a time, and its switch controller decides when to switch"

    def __init__(
        self, pools: Pools, routing: Routing, metrics: Metrics, coordination: Coordination, controller: SwitchController
    ) -> None:
        self.pools = pools
        self.routing = routing
        self.coordination = coordination
        self.controller = controller
        # The last PUT /admin/mode a follower carried to the leader, and the leader's answer: both shared.
        self._request: ModeRequest | None = None
        self._answer: ModeAnswer | None = None
        self._operator_switches = 0  # as the leader counts them (shared)
        self._joined = False  # has this replica applied the cluster's state yet (what it finds then is old news)
        metrics.registry.register(SwitchCollector(lambda: (controller.serving, controller.queued)))
        metrics.registry.register(ClusterCollector(coordination))

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
            "mode_request": self._request,
            "mode_answer": self._answer,
            "operator_switches": self._operator_switches,
        }
        return super().control().model_copy(update=published)

    async def apply_control(self, control: Control) -> None:
        """The leader runs a follower's PUT /admin/mode and publishes its answer; a follower mirrors the leader's
        mode, phase and pin (and its operator changes: the rate limit holds on every replica alike)."""
        await super().apply_control(control)
        request = control.mode_request
        if not self.coordination.leader:
            if self._joined and control.operator_switches > self._operator_switches:
                self.controller.operator_switched()
            self._request, self._answer, self._joined = request, control.mode_answer, True
            self._operator_switches = control.operator_switches
            self.controller.mirror(control.mode, control.phase, control.target, control.pinned)
            return
        self._joined = True
        if request is None or request == self._request:
            return
        self._request = request
        self._answer = self._run(request)

    def _run(self, request: ModeRequest) -> ModeAnswer:
        """A request carried from a follower, which found no switch under way when it took it: refused here only
        if one started meanwhile (or the rate limit says so). The refusal is not run later - the switch that won
        may have done what was asked, and an operator's intent is stale by then - but published for
        /admin/state on every replica and logged."""
        try:
            started = self.controller.request_switch(request.mode, pin=request.pin)
        except GatewayError as exc:
            log.warning("a PUT /admin/mode taken by another replica (request %s) is refused: %s", request.id, exc)
            return ModeAnswer(id=request.id, status=exc.status, error=str(exc))
        self._operator_switches += started
        return ModeAnswer(id=request.id, status=202 if started else 200)

    async def admit(self, on_cut: Callable[[str], None]) -> Lease:
        # During a switch this waits in the switch queue (bounded in length and time).
        lease = await self.controller.admit()
        lease.on_cut(on_cut)
        return lease

    def route(self, lease: Lease | None) -> tuple[str, str]:
        return lease.mode, ACTIVE_MODE

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
        snapshot["mode_request"] = self._request_view()
        return snapshot

    def _request_view(self) -> dict | None:
        """The last PUT /admin/mode a follower carried, and what the leader made of it (None: not yet answered)."""
        request, answer = self._request, self._answer
        if request is None:
            return None
        answered = answer is not None and answer.id == request.id
        return {**request.model_dump(), "answer": answer.model_dump(exclude={"id"}) if answered else None}

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
        controller = self.controller
        if self.coordination.leader:
            started = controller.request_switch(mode, pin=pin)
            self._operator_switches += started
            return controller.view(), 202 if started else 200
        mode = controller.check_request(mode)
        if mode is None and pin is None:
            return controller.view(), 200  # it serves already
        if mode is not None:
            controller.operator_switched()
        self._request = ModeRequest(id=uuid.uuid4().hex, mode=mode, pin=pin)
        return {**controller.view(), "mode_request": self._request_view()}, 202


class InEngine(Topology):
    """One pool of patched EAGLE-3 servers whose zero-step gate is the threshold (gateway/in_engine.py)."""

    name = "in-engine"
    no_policy = "has one pool, whose engines' zero-step gate is the threshold"

    def __init__(
        self, pools: Pools, routing: Routing, metrics: Metrics, coordination: Coordination, gates: GateSync
    ) -> None:
        self.pools = pools
        self.routing = routing
        self.coordination = coordination
        self.gates = gates
        metrics.registry.register(SwitchCollector())
        metrics.registry.register(GateCollector(gates))
        metrics.registry.register(ClusterCollector(coordination))

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

    def route(self, lease: Lease | None) -> tuple[str, str]:
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


def make_topology(
    settings: Settings,
    pools: Pools,
    routing: Routing,
    metrics: Metrics,
    breaker: Breaker,
    admission: Admission,
    client: httpx.AsyncClient,
    worker: Worker | None = None,
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
        )
        return InEngine(pools, routing, metrics, coordination, gates)
    return Partitioned(pools, routing, metrics, coordination)
