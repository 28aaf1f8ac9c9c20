"""The switch controller of a time-shared GPU set: one mode serves at a time and takes all traffic.

    controller = SwitchController(settings, pools, routing, metrics, breaker, client)  # with the gateway's state
    await controller.start()                # in the app's lifespan: adopt the mode that serves, start the timer
    lease = await controller.admit()        # per request: the mode that serves it (waits during a switch)
    lease.on_cut(callback)                  # called if the drain deadline cuts the request
    ...; lease.close()                      # in `finally`
    controller.request_switch("plain", pin=True)   # PUT /admin/mode
    await controller.stop()

What the controller does is the run of a switch; the rest is beside it, in what it holds or calls: *when* is the
pure stepper (`Switcher`, which `crossover sim replay` runs too), *how* the mechanism
(gateway/topology/switching/mechanisms.py), *holding requests meanwhile* the switch queue
(gateway/topology/switching/queue.py), *which mode serves at start-up or on taking the lease* adoption
(gateway/topology/switching/adoption.py; a start under way that a lost leader began is finished, not undone),
*when the serving mode is dead and how a mode comes back* recovery (gateway/topology/switching/recovery.py), *how far
apart failed attempts are* the backoff (gateway/topology/switching/backoff.py), *whether this replica acts or
follows the one that does* the replica (gateway/topology/switching/replicas.py: take-over, step-back, a switch its
fence refused, a follower's mirror). Adoption and recovery move the controller as `Host` (record.py) says.

One switch, each step bounded by a named timeout:

    active --preflight--> draining --> switching --> verifying --> active (new mode)
       |  (refused: nothing cut,          |             |
       |   nothing held; backoff)         +-------------+--> recovering --> active (a mode that verifies)
       |                                                                \\-> unavailable (503s; retried with
    serving mode dead for dead_after_probes health intervals --> recovering      backoff, or by the operator)

A GPU set that heals itself: when the serving mode has no usable backend for `dead_after_probes` health
intervals, the controller brings up whichever mode can serve soonest (the mechanism's `recovery_order`),
verifies it with a generation and serves; counted as a switch with reason `recovery`. A failed attempt
backs off (capped exponential, in /admin/state) and never teaches the switch-cost estimate.

While a switch is under way new requests wait in the switch queue and are served by whatever mode serves
next; past its bound or deadline they get 503 with Retry-After. Requests in flight on the old mode finish,
up to `drain_deadline`; then they are cut (an SSE error event and [DONE]) and counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable

import httpx

from crossover.gateway.backends import Breaker, Pools
from crossover.gateway.cluster import Coordination, Solo
from crossover.gateway.config import Settings, SwitchSettings
from crossover.gateway.errors import SHUTDOWN_MESSAGE, SwitchConflict, SwitchRateLimited, SwitchUnavailable
from crossover.gateway.metrics import Metrics
from crossover.gateway.modes import MODES, Mode, other
from crossover.gateway.policies import PolicySettings, SwitchDecision
from crossover.gateway.topology.routing import Routing
from crossover.gateway.topology.switching.adoption import Adoption, already_serving
from crossover.gateway.topology.switching.backoff import Backoff
from crossover.gateway.topology.switching.drain import drain
from crossover.gateway.topology.switching.mechanisms import ModeState, SwitchFailed, Target, make_mechanism
from crossover.gateway.topology.switching.queue import SwitchQueue
from crossover.gateway.topology.switching.record import (
    ADOPTED,
    OK,
    OPERATOR,
    RECOVERY,
    STARTUP,
    Phase,
    SwitchRecord,
)
from crossover.gateway.topology.switching.recovery import Recovery, ServingWatch, after_failed_switch
from crossover.gateway.topology.switching.replicas import Replica
from crossover.gateway.tracing import Tracing
from crossover.gateway.wire import bearer

__all__ = ["ACTIVE_MODE", "Lease", "Phase", "SwitchController", "SwitchUnavailable"]

log = logging.getLogger("crossover.switching")

MIN_RETRY_AFTER_S = 1

# The route decision reason (crossover_route_decisions_total) of every request a time-shared GPU set serves.
ACTIVE_MODE = "active_mode"

# The `reason` label of crossover_switch_dropped_total (the switch queue's own: switch_queue.py).
CUT = "cut"
NO_MODE = "no_mode"


class Lease:
    """One request admitted to a mode; the drain waits for it, and may cut it, until it is closed."""

    __slots__ = ("_callback", "_leases", "cut_reason", "mode")

    def __init__(self, mode: Mode, leases: set[Lease]) -> None:
        self.mode = mode
        self.cut_reason: str | None = None
        self._callback: Callable[[str], None] | None = None
        self._leases = leases
        leases.add(self)

    def on_cut(self, callback: Callable[[str], None]) -> None:
        """`callback(reason)` ends the request at the drain deadline (called at once if that has passed)."""
        self._callback = callback
        if self.cut_reason is not None:
            callback(self.cut_reason)

    def cut(self, reason: str) -> None:
        self.cut_reason = reason
        if self._callback is not None:
            self._callback(reason)

    def close(self) -> None:
        self._leases.discard(self)


def targets(settings: Settings, pools: Pools) -> dict[Mode, Target]:
    """What a mechanism moves: each mode's one server (and the agent or SGLang control API beside it)."""
    return {
        mode: Target(
            pools.pool(mode)[0].url,
            bearer(pools.pool(mode)[0].api_key),
            bearer(getattr(settings.pools, mode).control_key),
            getattr(settings.pools, mode).engine,
        )
        for mode in MODES
    }


def log_decision(mode: Mode | None, decision: SwitchDecision, last: SwitchDecision | None, cost_s: float) -> None:
    """The policy's decision, when it differs from the last one."""
    if last is not None and (last.switch, last.reason, last.mode) == (decision.switch, decision.reason, decision.mode):
        return
    log.info(
        "switch policy: %s (%s; window load %s, expected gain %.3g vs loss %.3g, switch cost %.3g s)",
        f"switch {mode} -> {decision.mode}" if decision.switch else f"stay in {mode} mode",
        decision.reason,
        decision.load,
        decision.gain,
        decision.loss,
        cost_s,
    )


def under_way(phase: Phase, target: Mode | None) -> str:
    """What clients are told: what is under way, never a URL or an exception (those go to the log)."""
    if target is None:
        return "the gateway is still finding out which mode of the GPU set serves"
    if phase is Phase.RECOVERING:
        return f"the GPU set is recovering: {target} mode is being brought up"
    return f"the GPU set is switching to {target} mode (phase {phase})"


def serving_failed(mode: Mode, dead_after_s: float) -> SwitchUnavailable:
    """The error for a request that the serving mode's server failed before it answered (the proxy raises it): a
    503 that says what happens next, never the backend's URL or exception (the log has those)."""
    return SwitchUnavailable(
        f"the {mode} mode's server did not answer; the gateway recovers the GPU set by itself if it stays so",
        code="serving_mode_failed",
        retry_after_s=max(MIN_RETRY_AFTER_S, math.ceil(dead_after_s)),
    )


def decision_view(decision: SwitchDecision) -> dict:
    return {"mode": decision.mode, "switch": decision.switch, "reason": decision.reason, "load": decision.load}


def count_switch(metrics: Metrics, record: SwitchRecord) -> None:
    """A switch or recovery that ended, in crossover_mode_switches_total and its kin."""
    metrics.mode_switches.labels(record.mechanism, record.to_mode, record.outcome).inc()
    metrics.switch_duration.observe(record.seconds)
    if record.reason == RECOVERY:
        metrics.recoveries.labels(record.mechanism, record.outcome).inc()


class SwitchController:
    """Owns the active mode of a time-shared GPU set; see the module docstring."""

    def __init__(
        self,
        settings: Settings,
        pools: Pools,
        routing: Routing,
        metrics: Metrics,
        breaker: Breaker,
        client: httpx.AsyncClient,
        *,
        coordination: Coordination | None = None,
        queued_elsewhere: Callable[[], int] = lambda: 0,
        clock: Callable[[], float] = time.monotonic,
        tracing: Tracing | None = None,
    ) -> None:
        self.settings = settings.switching
        self.tracing = tracing  # a span per switch, its phases as events (gateway/tracing.py); None: off
        self.health_interval = settings.health.interval
        self.pools = pools
        self.routing = routing
        self.metrics = metrics
        self.breaker = breaker
        self.queued_elsewhere = queued_elsewhere
        # Replicas: only the lease holder decides and moves the GPU set; the others mirror what it publishes.
        self.coordination = coordination if coordination is not None else Solo()
        self.replica = Replica(self.coordination, take_over=self._take_over, step_back=self._step_back, clock=clock)
        self.clock = clock
        self.mode: Mode | None = self.settings.initial_mode
        self.phase = Phase.STARTING
        self.mode_since = clock()
        self.target: Mode | None = None
        self.last_switch: SwitchRecord | None = None
        self.last_decision: SwitchDecision | None = None
        self.switches = 0
        self.recoveries = 0
        self.switch = SwitchSettings.of(settings)  # what the policy runs, as `crossover sim replay` runs it
        self.switcher = self.switch.switcher()
        self.backoff = Backoff(self.settings.backoff, self.settings.backoff_max)
        self.pinned = False
        self.watch = ServingWatch(self.settings.dead_after_probes * self.health_interval)
        self.targets = targets(settings, pools)
        self.leases: dict[Mode, set[Lease]] = {mode: set() for mode in MODES}
        self.queue = SwitchQueue(
            self.settings.queue_max,
            self.settings.queue_timeout,
            on_drop=lambda reason: metrics.switch_dropped.labels(reason).inc(),
        )
        self._mechanism = make_mechanism(
            self.settings, self.targets, client, self.inflight, fence=self.coordination.token
        )
        # The runs beside a switch: bringing a mode back (recovery.py), finding what serves (adoption.py).
        mechanism, initial = self._mechanism, self.settings.initial_mode
        self.recovery = Recovery(
            self, mechanism, self.replica, pools, breaker, self.watch, initial=initial, clock=clock
        )
        self.adoption = Adoption(
            self, mechanism, self.replica, self.settings, clock=clock, bring_up=lambda: self.recovery.run(None, STARTUP)
        )
        self._timer: asyncio.Task | None = None
        self._task: asyncio.Task | None = None
        self._adopting = False  # the task finds out what serves (start-up, or the lease just taken)
        # Runs once an adoption has ended (the time-shared topology: an operator's request that waited for it).
        self.after_adoption: Callable[[], None] = lambda: None
        self._last_operator = -math.inf
        self._next_look = -math.inf  # while no mode serves: when to look for one that serves by itself
        self._closed = False

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Begin serving: adopt whichever mode serves (or bring one up) in the background; start the timer. A
        follower waits for the leader's word (`mirror`) instead."""
        self.replica.start()
        self._timer = asyncio.create_task(self._run())

    async def stop(self) -> None:
        self._closed = True
        for task in (self._timer, self._task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._timer = self._task = None
        self.queue.settle()

    # -- the request path -----------------------------------------------------------------------

    @property
    def serving(self) -> Mode | None:
        """The mode that serves (None while none does)."""
        return self.mode if self.phase is not Phase.UNAVAILABLE else None

    @property
    def queued(self) -> int:
        return len(self.queue)

    @property
    def busy(self) -> bool:
        return self._task is not None and not self._task.done()

    def inflight(self, mode: Mode) -> int:
        """Requests on `mode`: admitted ones (leases) and whatever pools counts on its backends, here and through
        the cluster's other replicas."""
        return max(len(self.leases[mode]), self.pools.inflight(mode)) + self.pools.elsewhere(mode)

    async def admit(self) -> Lease:
        """The lease of the mode that serves this request; waits while a switch is under way, else 503."""
        if self.phase is not Phase.ACTIVE:
            await self.queue.wait(self._may_serve, lambda: under_way(self.phase, self.target), self._retry_after)
        return Lease(self.mode, self.leases[self.mode])

    def _may_serve(self) -> bool:
        if self.phase is Phase.ACTIVE:
            return True
        if self._closed:
            raise SwitchUnavailable(SHUTDOWN_MESSAGE, code="gateway_unavailable")
        if self.phase is Phase.UNAVAILABLE:
            self.metrics.switch_dropped.labels(NO_MODE).inc()
            raise SwitchUnavailable(
                "no mode of the time-shared GPU set serves; the gateway is bringing one up by itself",
                code="no_serving_mode",
                retry_after_s=self._retry_after(),
            )
        return False

    def serving_failed(self, mode: Mode) -> SwitchUnavailable:
        return serving_failed(mode, self.settings.dead_after_probes * self.health_interval)

    def _retry_after(self) -> int:
        now = self.clock()
        if self.phase is Phase.UNAVAILABLE:
            return max(MIN_RETRY_AFTER_S, math.ceil(self.backoff.next_at - now + self.switcher.cost.estimate_s))
        elapsed = time.time() - self.last_switch.started_at if self.last_switch else 0.0
        return max(MIN_RETRY_AFTER_S, math.ceil(self.switcher.cost.estimate_s - elapsed))

    # -- operator -------------------------------------------------------------------------------

    def request_switch(self, mode: Mode | None, *, pin: bool | None = None, reason: str = OPERATOR) -> bool:
        """PUT /admin/mode: switch to `mode` now (policy bypassed) and/or pin (True) or unpin (False) it.

        True when a switch started; SwitchConflict while one runs, SwitchRateLimited if the last operator
        change was under `operator_interval` ago. A dead active server needs no release: one call recovers.
        """
        mode = self.check_request(mode)
        if pin is not None:
            self.pinned = pin
            log.info("mode %s by the operator", "pinned" if pin else "unpinned")
        if mode is None:
            return False
        self.operator_switched()
        self.backoff.succeeded()  # the operator's call is the next attempt
        self._begin(mode, reason)
        return True

    def check_request(self, mode: Mode | None) -> Mode | None:
        """What PUT /admin/mode refuses, on this replica's view (a follower's: the phase its leader published): the
        mode to switch to, None if it serves already; SwitchConflict or SwitchRateLimited as `request_switch`."""
        if mode is not None and self.under_way:
            raise SwitchConflict(f"{under_way(self.phase, self.target)}; try again when it has ended", param="mode")
        if self.phase is Phase.ACTIVE and self.mode == mode:
            return None  # it serves already: nothing to switch (and nothing to rate-limit)
        now = self.clock()
        wait = self._last_operator + self.settings.operator_interval - now
        if mode is not None and wait > 0:
            raise SwitchRateLimited(
                f"the mode was changed by an operator {now - self._last_operator:.1f} s ago; one change per "
                f"{self.settings.operator_interval:g} s",
                retry_after_s=max(MIN_RETRY_AFTER_S, math.ceil(wait)),
            )
        return mode

    @property
    def under_way(self) -> bool:
        """A switch, recovery or start-up is under way: run here, or (a follower) as the leader published it."""
        if self.replica.acting:
            return self.busy
        return self.phase not in (Phase.ACTIVE, Phase.UNAVAILABLE)

    def operator_switched(self) -> None:
        """An operator's switch started (here, or by the leader for this follower): the next waits its turn."""
        self._last_operator = self.clock()

    def view(self) -> dict:
        decision = self.last_decision
        now = self.clock()
        return {
            "mode": self.serving,
            "phase": str(self.phase),
            "target": self.target,
            "mechanism": self.settings.mechanism,
            "pinned": self.pinned,
            "in_mode_s": round(now - self.mode_since, 3),
            "switch_queued": self.queued,
            "switches": self.switches,
            "recoveries": self.recoveries,
            "switch_cost_s": round(self.switcher.cost.estimate_s, 4),
            "backoff": self.backoff.view(now),
            "serving_dead_for_s": None if self.watch.dead_since is None else round(now - self.watch.dead_since, 3),
            "last_switch": self.last_switch.view() if self.last_switch else None,
            "last_decision": None if decision is None else decision_view(decision),
        }

    # -- the timer ------------------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.settings.interval)
            try:
                self.tick()
            except Exception:  # a bug in one tick must not end switching for the gateway's lifetime
                log.exception("switch controller tick failed")

    # -- replicas -------------------------------------------------------------------------------

    @property
    def acting(self) -> bool:
        """This replica runs the switches (gateway/topology/switching/replicas.py); a follower mirrors its leader."""
        return self.replica.acting

    @acting.setter
    def acting(self, acting: bool) -> None:
        self.replica.acting = acting

    def _take_over(self) -> None:
        """This replica took the lease: adopt what really serves before deciding anything."""
        self._adopting = True
        self._task = asyncio.create_task(self._adopt())

    @property
    def adopting(self) -> bool:
        """This replica is finding out which mode serves (start-up, or the lease just taken): no switch is under way
        yet, so a carried operator's request waits for it rather than being refused (replicas.py)."""
        return self._adopting and self.busy

    async def _adopt(self) -> None:
        """At start-up, or on taking the lease: serve what really serves (adoption.py); then, if a mode served as it
        was, an operator's switch the fence refused, if it is recent and still to be made (replicas.py)."""
        try:
            served = await self.adoption.adopt()
        finally:
            self._adopting = False
        if served and (refused := self.replica.refused_again(self.mode)) is not None:
            self._begin(refused, OPERATOR)
        # Once this task has ended: until then a switch it would start is refused as one under way.
        asyncio.get_running_loop().call_soon(self._adopted)

    def _adopted(self) -> None:
        if not self._closed:  # a switch begun now would outlive `stop`
            self.after_adoption()

    def _step_back(self) -> None:
        """The lease is gone: a switch under way ends where it is (the new leader adopts what it left)."""
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def mirror(self, mode: Mode | None, phase: str | None, target: Mode | None, pinned: bool) -> None:
        """A follower: what the leader published (replicas.py)."""
        self.replica.mirror(self, mode, phase, target, pinned)

    def policy_settings(self) -> PolicySettings:
        return self.switch.policy(self.routing.threshold, self.routing.hysteresis)

    def tick(self) -> None:
        """One sampling period (the timer calls it every `interval`; tests may call it with their own clock)."""
        now = self.clock()
        settings = self.policy_settings()
        load = self.pools.total_load() + self.queued + self.queued_elsewhere()
        self.switcher.observe(now, load, settings)
        if not self.replica.acts() or self.busy:
            return
        if self.phase is Phase.UNAVAILABLE:
            if self.backoff.ready(now):
                self._task = asyncio.create_task(self.recovery.run(None))
            elif now >= self._next_look:
                # Between attempts, every probe interval: a mode may have come up by itself (an agent that died
                # while it started the target leaves that server starting). Adopt it, with no operator.
                self._next_look = now + self.health_interval
                self._task = asyncio.create_task(self.adoption.adopt_if_serving())
            return
        if self.phase is not Phase.ACTIVE:
            return
        if self.watch.dead(now, self.mode, self.pools.pool(self.mode)):
            if self.backoff.ready(now):
                self._task = asyncio.create_task(self.recovery.run(self.mode))
            return
        if self.settings.mechanism == "manual" or self.pinned or not self.backoff.ready(now):
            return
        decision = self.switcher.decide(now, mode=self.mode, mode_since=self.mode_since, settings=settings)
        log_decision(self.mode, decision, self.last_decision, self.switcher.cost.estimate_s)
        self.last_decision = decision
        if decision.switch:
            self._begin(decision.mode, decision.reason)

    # -- one switch -----------------------------------------------------------------------------

    def _begin(self, target: Mode, reason: str) -> None:
        self.target = target
        self._task = asyncio.create_task(self._switch(target, reason))

    def _enter(self, phase: Phase) -> None:
        self.phase = phase
        if self.tracing is not None:
            self.tracing.event(str(phase))  # on the switch's span, when a switch runs (this task's current span)
        if phase in (Phase.ACTIVE, Phase.UNAVAILABLE):
            self.queue.settle()

    def _activate(self, mode: Mode) -> None:
        if mode != self.mode or self.phase is not Phase.ACTIVE:
            self.mode_since = self.clock()
        self.mode = mode
        self.target = None
        self.watch.reset()
        self._mechanism.adopted(mode)
        for backend in self.pools.pool(mode):
            self.breaker.wake(backend)  # it just generated: any failure from its off time is over
        for backend in self.pools.pool(other(mode)):
            self.breaker.rest(backend)  # out of service on purpose: its failed probes are not ejections
        self._enter(Phase.ACTIVE)

    def _finish(self, record: SwitchRecord, serving: Mode | None, started: float) -> None:
        """Account for a switch or recovery that ended, and serve what serves."""
        record.ended(serving, self.clock() - started)
        self.switches += 1
        count_switch(self.metrics, record)
        if record.outcome == OK:
            self.backoff.succeeded()
            if record.reason not in (RECOVERY, STARTUP, ADOPTED):
                # Only a whole switch that succeeded says what one costs (an adopted one is its last part).
                self.switcher.switched(record.seconds)
        else:
            delay = self.backoff.failed(self.clock())
            log.warning("next switch or recovery attempt in %.3g s at the earliest (backoff)", delay)
        record.log_end()
        if serving is None:
            self.target = None
            self._enter(Phase.UNAVAILABLE)
            return
        self._activate(serving)

    async def _switch(self, target: Mode, reason: str) -> None:
        if self.tracing is None:
            await self._run_switch(target, reason)
            return
        attributes = {"crossover.switch.to": target, "crossover.switch.reason": reason}
        with self.tracing.span("crossover.switch", attributes) as span:
            await self._run_switch(target, reason)
            record = self.last_switch
            if record is not None and record.to_mode == target:
                span.set_attribute("crossover.switch.from", record.from_mode or "none")
                span.set_attribute("crossover.switch.mechanism", record.mechanism)
                span.set_attribute("crossover.switch.outcome", record.outcome or "refused")
                span.set_attribute("crossover.switch.cut_requests", record.cut_requests)
                if record.error:
                    self.tracing.failed(span, f"{record.failed_step}: {record.error}")

    async def _run_switch(self, target: Mode, reason: str) -> None:
        old = self.mode if self.phase is Phase.ACTIVE else None
        mechanism = self._mechanism
        record = SwitchRecord(old, target, mechanism.name, reason)
        started = self.clock()
        try:
            # Before anything is drained: can it succeed? A switch refused here has cut and held nothing.
            await mechanism.preflight(old, target)
        except SwitchFailed as failure:
            if self.replica.fenced(failure):
                self.replica.refused(record, failure, target)
                self.last_switch = record
                return
            record.failed_step, record.error = failure.step, failure.message
            self.last_switch = record
            log.error("switch %s -> %s (%s) not started: %s", old, target, mechanism.name, failure)
            serving = old if old is not None and self.phase is Phase.ACTIVE else None
            if serving is None:
                # No mode serves (say the agent is gone): an operator's call still serves one that serves as it is.
                serving = await already_serving(self._mechanism, target)
            self._finish(record, serving, started)
            return
        if old is not None and old != target and await mechanism.mode_state(old) is ModeState.DEAD:
            log.warning("the %s server is dead: nothing to drain or release", old)
            old = None
        self.last_switch = record
        try:
            if old is not None and old != target:
                self._enter(Phase.DRAINING)
                record.cut_requests = await self._drain(old, target)
                record.drain_s = self.clock() - started
            self._enter(Phase.SWITCHING)
            for backend in self.pools.pool(old or other(target)):
                self.breaker.rest(backend)  # released or stopped on purpose from here on
            await mechanism.hand_over(old if old != target else None, target)
            self._enter(Phase.VERIFYING)
            await mechanism.verify(target)
        except SwitchFailed as failure:
            if self.replica.fenced(failure):
                self.replica.refused(record, failure, target)
                self.last_switch = record
                return
            record.failed_step, record.error = failure.step, failure.message
            log.error(
                "switch %s -> %s (%s) failed at %s: %s; recovering", old, target, mechanism.name, failure.step, failure
            )
            self._enter(Phase.RECOVERING)
            serving = await after_failed_switch(mechanism, old, target)
        except Exception as exc:  # a bug must not leave the gateway holding requests forever
            record.failed_step, record.error = "internal", repr(exc)
            log.exception("switch %s -> %s failed unexpectedly; recovering", old, target)
            self._enter(Phase.RECOVERING)
            serving = await after_failed_switch(mechanism, old, target)
        else:
            serving = target
        self._finish(record, serving, started)

    async def _drain(self, old: Mode, target: Mode) -> int:
        """Wait for the old mode's requests, up to the drain deadline; then cut them. Returns how many were cut."""
        cut = await drain(
            old,
            target,
            self.leases[old],
            inflight=self.inflight,
            here=lambda: max(len(self.leases[old]), self.pools.inflight(old)),
            caught_up=self.coordination.caught_up,
            deadline_s=self.settings.drain_deadline,
        )
        if cut:
            self.metrics.switch_dropped.labels(CUT).inc(cut)
        return cut
