"""The deployment's shape behind one interface: partitioned pools, a time-shared GPU set, or in-engine gates.

    topology = make_topology(settings, pools, routing, metrics, breaker, admission, client)   # factory.py
    await topology.start() ... await topology.stop()       # the app's lifespan (and the cluster's membership)
    lease = await topology.admit(on_cut)                    # a request: its place on the mode that serves (or None)
    pool, reason = topology.route(lease, tier)              # ... and the pool it goes to (tier: its service_tier)
    topology.direct_lane                                    # may the direct lane take a request here?
    await topology.set_mode("plain", pin=True)              # PUT /admin/mode: (view, status), or NotForTopology
    await topology.share()                                  # after either PUT: live on every replica

With replicas (gateway/cluster/coordination.py), the threshold, hysteresis, policy, mode and pin are the cluster's: a
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

A request's OpenAI `service_tier` (`route`'s `tier`): partitioned, `priority` may take the speculative pool above the
threshold (up to `priority_headroom`) and `flex` takes plain while plain can serve (gateway/policies/route.py's
`for_tier`). Time-shared and in-engine serve one mode at a time, so a tier cannot choose one: there it only orders
the gateway's own admission queue (gateway/admission.py: priority first, flex last and shed first). The switch queue
releases every held request at once when a mode serves, so ordering it would change nothing; in-engine, the engines'
gate decides whether a request is speculated, and it sees no tier.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar, Protocol

from crossover.gateway.backends import Pools
from crossover.gateway.cluster import ClusterCollector, Control, Coordination, StoreUnavailable
from crossover.gateway.config import ThresholdError, TopologyName
from crossover.gateway.errors import GatewayError, NotForTopology, StateNotShared
from crossover.gateway.metrics import Metrics
from crossover.gateway.modes import PLAIN, SPECULATIVE, Mode
from crossover.gateway.topology.routing import Routing

log = logging.getLogger("crossover.topology")

# What a PUT /admin/threshold may name (gateway/admin.py's ThresholdUpdate).
THRESHOLD, HYSTERESIS, POLICY = "threshold", "hysteresis", "policy"


class ModeLease(Protocol):
    """A request's place on the mode that serves it (time-shared): cut when a switch ends its mode, closed when the
    request ends."""

    mode: Mode

    def on_cut(self, callback: Callable[[str], None]) -> None: ...

    def close(self) -> None: ...


class Topology(ABC):
    """The interface: what every topology shares (the cluster's state, the admin API's checks), and what each must
    say for itself (abstract: a topology that forgets one cannot be built, rather than behaving as another)."""

    # Its name in settings and in /admin/state.
    name: ClassVar[TopologyName]
    # Whether the inline lane (gateway/request/inline.py) may take a request: it waits on nothing, so not where a
    # request may have to wait for a mode.
    direct_lane: ClassVar[bool]
    # Whether a request its pool cannot serve may go to the other pool.
    other_pool: ClassVar[bool]
    # Why a routing policy (PUT /admin/threshold's `policy`) means nothing here; None: it is this topology's.
    no_policy: ClassVar[str | None]

    def __init__(self, pools: Pools, routing: Routing, metrics: Metrics, coordination: Coordination) -> None:
        self.pools = pools
        self.routing = routing
        self.coordination = coordination
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
        return Control(
            threshold=routing.threshold,
            hysteresis=routing.hysteresis,
            policy=routing.policy,
            priority_headroom=routing.priority_headroom,
            spillover_share=routing.spillover_share,
            adaptive_paused=routing.adaptive_paused,
            adaptive=routing.adaptive_shared,
        )

    async def apply_control(self, control: Control) -> None:
        """What another replica changed; never raises (a bad value is logged and the old one serves)."""
        self.routing.adaptive_paused = control.adaptive_paused
        if not self.coordination.leader:  # the leader's own is the one it shares
            self.routing.adaptive_shared = control.adaptive
        try:
            self.routing.update(
                control.threshold,
                control.hysteresis,
                control.policy,
                control.priority_headroom,
                control.spillover_share,
            )
        except ThresholdError as exc:
            log.error("the cluster's control state does not apply here (%s): keeping the live one", exc)
        except OSError:
            pass  # live, not saved: Routing said so (state_file_problem)

    async def share(self) -> None:
        """After a PUT: the change is written for every replica now (503 if it could not be: live here only, and
        written for the others when the cluster's store answers again - unless another replica's change to the same
        setting reached the store meanwhile: that one is newer, and replaces this one here too)."""
        try:
            await self.coordination.share()
        except StoreUnavailable as exc:
            raise StateNotShared(
                f"the change is live on this replica only: the cluster's store did not take it ({exc}). It reaches "
                "the others once the store answers, unless another replica changes the same setting first"
            ) from None

    async def refresh(self) -> None:
        """Before an admin read: what another replica changed since the last sync is read first."""
        await self.coordination.refresh()

    # -- the request path -----------------------------------------------------------------------

    async def admit(self, on_cut: Callable[[str], None]) -> ModeLease | None:
        """The request's place on the mode that serves it (`on_cut(reason)` ends it early); None: nothing to hold."""
        return None

    @abstractmethod
    def route(self, lease: ModeLease | None, tier: str | None = None) -> tuple[str, str]:
        """(pool, reason) for a new request; `tier`: its OpenAI `service_tier` (None: it named none)."""

    def trace_view(self) -> dict[str, str | int | None]:
        """What a request's trace says of the decision it met (gateway/tracing.py puts each key under `crossover.`):
        the topology, the policy, the threshold and the loads the policy saw (time-shared: the mode and its phase)."""
        routing, pools = self.routing, self.pools
        return {
            "topology": self.name,
            "policy": routing.policy if self.no_policy is None else None,
            "threshold": routing.threshold,
            "loads.speculative": pools.pool_load(SPECULATIVE),
            "loads.plain": pools.pool_load(PLAIN),
        }

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
        return None

    def threshold_view(self) -> dict:
        """What GET/PUT /admin/threshold adds to the routing state."""
        return {}

    def state_view(self, snapshot: dict) -> dict:
        """/admin/state: the gateway's snapshot as this topology sees it."""
        return snapshot

    @abstractmethod
    def mode_view(self) -> dict:
        """GET /admin/mode."""

    @abstractmethod
    async def set_mode(self, mode: Mode | None, pin: bool | None) -> tuple[dict, int]:
        """PUT /admin/mode: (the view after it, the HTTP status)."""
