"""The switch controller of a time-shared GPU set: one mode serves at a time and takes all traffic.

    controller = SwitchController(settings, pools, routing, metrics, breaker)  # built with the gateway's state
    await controller.start(client)          # in the app's lifespan: verify the initial mode, start the timer
    lease = await controller.admit()        # per request: the mode that serves it (waits during a switch)
    lease.on_cut(callback)                  # called if the drain deadline cuts the request
    ...; lease.close()                      # in `finally`
    controller.request_switch("plain")      # PUT /admin/mode
    await controller.stop()

Phases of one switch (each step bounded by a named timeout; a failure at any step recovers):

    active --> draining --> switching --> verifying --> active (new mode)
                  |             |             |
                  +-------------+-------------+--> recovering --> active (a mode that verifies)
                                                              \\-> unavailable (503s; retried every
                                                                  RECOVERY_INTERVAL_S, or by the operator)

While a switch is under way new requests wait in a bounded queue (`queue_max`, `queue_timeout`) and are
served by whatever mode serves next; past the bound or the deadline they get 503 with Retry-After. Requests
in flight on the old mode finish, up to `drain_deadline`; then they are cut (an SSE error event and
[DONE]) and counted. The decision itself is gateway/switch_policy.py's, on a timer, with the real clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

import httpx

from crossover.gateway import switch_policy
from crossover.gateway.config import PLAIN, SPECULATIVE, Settings
from crossover.gateway.errors import GatewayError, Unavailable
from crossover.gateway.headers import bearer
from crossover.gateway.health import Breaker
from crossover.gateway.metrics import Metrics
from crossover.gateway.pools import Pools
from crossover.gateway.routing import Routing
from crossover.gateway.switch_mechanisms import Mechanism, SwitchFailed, make_mechanism, verify

log = logging.getLogger("crossover.switching")

# Requests cut at the drain deadline must be gone within this long (their streams end at once).
CUT_GRACE_S = 5.0
DRAIN_POLL_S = 0.02
# With no mode serving: how often the controller tries a 1-token generation on each mode's server.
RECOVERY_INTERVAL_S = 5.0
MIN_RETRY_AFTER_S = 1

# Outcomes (the `outcome` label of crossover_mode_switches_total).
OK = "ok"
FAILED = "failed"  # the switch failed; the gateway serves a mode again (usually the old one)
UNAVAILABLE = "unavailable"  # the switch failed and no mode serves: 503s until one does

# The route decision reason (crossover_route_decisions_total) of every request a time-shared GPU set serves.
ACTIVE_MODE = "active_mode"

# Reasons a switch starts besides the policy's.
OPERATOR = "operator"
RECOVERY = "recovery"

# The `reason` label of crossover_switch_dropped_total.
CUT = "cut"
QUEUE_FULL = "queue_full"
QUEUE_TIMEOUT = "queue_timeout"
NO_MODE = "no_mode"


class Phase(StrEnum):
    STARTING = "starting"
    ACTIVE = "active"
    DRAINING = "draining"
    SWITCHING = "switching"
    VERIFYING = "verifying"
    RECOVERING = "recovering"
    UNAVAILABLE = "unavailable"


class SwitchUnavailable(Unavailable):
    """503 with Retry-After: the switch queue is full or too slow, no mode serves, or a switch cut the request."""

    def __init__(self, message: str, *, code: str, retry_after_s: int = MIN_RETRY_AFTER_S) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        self.code = code


class SwitchConflict(GatewayError):
    status, type, code = 409, "invalid_request_error", "switch_in_progress"


class Lease:
    """One request admitted to a mode; the drain waits for it, and may cut it, until it is closed."""

    __slots__ = ("_callback", "_leases", "cut_reason", "mode")

    def __init__(self, mode: str, leases: set[Lease]) -> None:
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


@dataclass
class SwitchRecord:
    """One switch, for /admin/state and the logs."""

    from_mode: str | None
    to_mode: str
    mechanism: str
    reason: str
    started_at: float = field(default_factory=time.time)
    outcome: str | None = None
    mode_after: str | None = None
    duration_s: float | None = None
    drain_s: float | None = None
    cut_requests: int = 0
    failed_step: str | None = None
    error: str | None = None

    def view(self) -> dict:
        return {
            "from": self.from_mode,
            "to": self.to_mode,
            "mechanism": self.mechanism,
            "reason": self.reason,
            "started_at": self.started_at,
            "outcome": self.outcome,
            "mode_after": self.mode_after,
            "duration_s": None if self.duration_s is None else round(self.duration_s, 4),
            "drain_s": None if self.drain_s is None else round(self.drain_s, 4),
            "cut_requests": self.cut_requests,
            "failed_step": self.failed_step,
            "error": self.error,
        }


class SwitchController:
    """Owns the active mode of a time-shared GPU set; see the module docstring."""

    def __init__(
        self,
        settings: Settings,
        pools: Pools,
        routing: Routing,
        metrics: Metrics,
        breaker: Breaker,
        *,
        queued_elsewhere: Callable[[], int] = lambda: 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings.switching
        self.pools = pools
        self.routing = routing
        self.metrics = metrics
        self.breaker = breaker
        self.queued_elsewhere = queued_elsewhere
        self.clock = clock
        self.mode: str | None = self.settings.initial_mode
        self.phase = Phase.STARTING
        self.mode_since = clock()
        self.target: str | None = None
        self.last_switch: SwitchRecord | None = None
        self.last_decision: switch_policy.SwitchDecision | None = None
        self.switches = 0
        self.cost = switch_policy.SwitchCost(prior_s=self.settings.initial_cost)
        self.phases = switch_policy.PhaseHistory()
        self.samples: deque[switch_policy.LoadSample] = deque()
        self.urls = {name: pools.pool(name)[0].url for name in (SPECULATIVE, PLAIN)}
        self.headers = {name: bearer(pools.pool(name)[0].api_key) for name in (SPECULATIVE, PLAIN)}
        self.leases: dict[str, set[Lease]] = {SPECULATIVE: set(), PLAIN: set()}
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._client: httpx.AsyncClient | None = None
        self._mechanism: Mechanism | None = None
        self._timer: asyncio.Task | None = None
        self._task: asyncio.Task | None = None
        self._last_recovery = -math.inf
        self._closed = False
        metrics.switch_source = lambda: (self.mode if self.phase is not Phase.UNAVAILABLE else None, self.queued)

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self, client: httpx.AsyncClient) -> None:
        """Begin serving: verify the initial mode (or whichever serves) in the background; start the timer."""
        self._client = client
        self._mechanism = make_mechanism(self.settings, self.urls, client, self.headers, self.inflight)
        self._task = asyncio.create_task(self._recover_task(self.settings.initial_mode, first=True))
        self._timer = asyncio.create_task(self._run())

    async def stop(self) -> None:
        self._closed = True
        for task in (self._timer, self._task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._timer = self._task = None
        self._settle()

    # -- the request path -----------------------------------------------------------------------

    @property
    def queued(self) -> int:
        return len(self._waiters)

    def inflight(self, mode: str) -> int:
        """Requests on `mode`: admitted ones (leases) and whatever pools counts on its backends."""
        return max(len(self.leases[mode]), self.pools.inflight(mode))

    async def admit(self) -> Lease:
        """The lease of the mode that serves this request; waits while a switch is under way, else 503."""
        if self.phase is Phase.ACTIVE:
            return Lease(self.mode, self.leases[self.mode])
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.queue_timeout
        while True:
            if self.phase is Phase.ACTIVE:
                return Lease(self.mode, self.leases[self.mode])
            if self._closed:
                raise SwitchUnavailable("the gateway is shutting down; retry the request", code="gateway_unavailable")
            if self.phase is Phase.UNAVAILABLE:
                self.metrics.switch_dropped.labels(NO_MODE).inc()
                raise SwitchUnavailable(
                    f"no mode of the time-shared GPU set serves: {self._why_unavailable()}",
                    code="no_serving_mode",
                    retry_after_s=math.ceil(RECOVERY_INTERVAL_S),
                )
            if len(self._waiters) >= self.settings.queue_max:
                self.metrics.switch_dropped.labels(QUEUE_FULL).inc()
                raise SwitchUnavailable(
                    f"{self._under_way()} and {self.settings.queue_max} requests already wait for it",
                    code="switch_queue_full",
                    retry_after_s=self._retry_after(),
                )
            waiter = loop.create_future()
            self._waiters.append(waiter)
            try:
                async with asyncio.timeout_at(deadline):
                    await waiter
            except TimeoutError:
                self.metrics.switch_dropped.labels(QUEUE_TIMEOUT).inc()
                raise SwitchUnavailable(
                    f"waited {self.settings.queue_timeout:g} s while {self._under_way()}",
                    code="switch_queue_timeout",
                    retry_after_s=self._retry_after(),
                ) from None
            finally:
                # A client that leaves (cancellation) or times out frees its place at once.
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)

    def _settle(self) -> None:
        """A switch ended (a mode serves, or none does): every waiting request looks again."""
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _retry_after(self) -> int:
        elapsed = time.time() - self.last_switch.started_at if self.last_switch else 0.0
        return max(MIN_RETRY_AFTER_S, math.ceil(self.cost.estimate_s - elapsed))

    def _why_unavailable(self) -> str:
        record = self.last_switch
        if record is not None and record.error:
            switch = f"{record.from_mode} -> {record.to_mode}"
            return f"the last switch ({switch}) failed at {record.failed_step}: {record.error}"
        return "neither mode's server answers a 1-token generation"

    def _under_way(self) -> str:
        if self.target is None:
            return "the gateway is still finding out which mode serves"
        return f"the GPU set is switching to {self.target} mode (phase {self.phase})"

    # -- operator -------------------------------------------------------------------------------

    def request_switch(self, mode: str, reason: str = OPERATOR) -> bool:
        """Start a switch to `mode` now (policy bypassed); False when it already serves. SwitchConflict if busy."""
        if self._task is not None and not self._task.done():
            raise SwitchConflict(f"{self._under_way()}; try again when it has ended", param="mode")
        if self.phase is Phase.ACTIVE and self.mode == mode:
            return False
        self._begin(mode, reason)
        return True

    def view(self) -> dict:
        decision = self.last_decision
        return {
            "mode": self.mode if self.phase is not Phase.UNAVAILABLE else None,
            "phase": str(self.phase),
            "target": self.target,
            "mechanism": self.settings.mechanism,
            "in_mode_s": round(self.clock() - self.mode_since, 3),
            "queued": self.queued,
            "switches": self.switches,
            "switch_cost_s": round(self.cost.estimate_s, 4),
            "last_switch": self.last_switch.view() if self.last_switch else None,
            "last_decision": None
            if decision is None
            else {"mode": decision.mode, "switch": decision.switch, "reason": decision.reason, "load": decision.load},
        }

    # -- the timer ------------------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.settings.interval)
            try:
                self._tick()
            except Exception:  # a bug in one tick must not end switching for the gateway's lifetime
                log.exception("switch controller tick failed")

    def policy_settings(self) -> switch_policy.SwitchSettings:
        s = self.settings
        return switch_policy.SwitchSettings(
            threshold=self.routing.threshold,
            hysteresis=self.routing.hysteresis,
            min_dwell_s=s.dwell,
            window_s=s.window,
            expected_phase_s=s.expected_phase or None,
            prior_phase_s=s.prior_phase,
            rates=switch_policy.ThresholdRates(self.routing.threshold, s.advantage),
        )

    def _tick(self) -> None:
        now = self.clock()
        settings = self.policy_settings()
        load = self.pools.total_load() + self.queued + self.queued_elsewhere()
        self.samples.append(switch_policy.LoadSample(now, load))
        while self.samples and self.samples[0].t <= now - settings.window_s:
            self.samples.popleft()
        self.phases = self.phases.observe(
            switch_policy.window_load(self.samples, now, settings.window_s), now, settings
        )
        busy = self._task is not None and not self._task.done()
        if busy:
            return
        if self.phase is Phase.UNAVAILABLE:
            if now - self._last_recovery >= RECOVERY_INTERVAL_S:
                self._last_recovery = now
                self._task = asyncio.create_task(self._recover_task(self.target or self.settings.initial_mode))
            return
        if self.phase is not Phase.ACTIVE or self.settings.mechanism == "manual":
            return
        decision = switch_policy.decide(
            self.samples,
            now=now,
            mode=self.mode,
            mode_since=self.mode_since,
            switch_cost_s=self.cost.estimate_s,
            settings=settings,
            phases=self.phases,
        )
        self.last_decision = decision
        if decision.switch:
            log.info(
                "switching %s -> %s: %s (window load %s, expected gain %.3g > loss %.3g)",
                self.mode,
                decision.mode,
                decision.reason,
                decision.load,
                decision.gain,
                decision.loss,
            )
            self._begin(decision.mode, decision.reason)

    # -- one switch -----------------------------------------------------------------------------

    def _begin(self, target: str, reason: str) -> None:
        self.target = target
        self._task = asyncio.create_task(self._switch(target, reason))

    def _enter(self, phase: Phase) -> None:
        self.phase = phase
        if phase in (Phase.ACTIVE, Phase.UNAVAILABLE):
            self._settle()

    def _activate(self, mode: str) -> None:
        if mode != self.mode or self.phase is not Phase.ACTIVE:
            self.mode_since = self.clock()
        self.mode = mode
        self.target = None
        for backend in self.pools.pool(mode):
            self.breaker.succeeded(backend)  # it just generated: any ejection from its off time is over
        self._enter(Phase.ACTIVE)

    async def _switch(self, target: str, reason: str) -> None:
        old = self.mode if self.phase is not Phase.UNAVAILABLE else None
        mechanism = self._mechanism
        record = SwitchRecord(old, target, mechanism.name, reason)
        self.last_switch = record
        started = self.clock()
        try:
            if old is not None and old != target:
                self._enter(Phase.DRAINING)
                record.cut_requests = await self._drain(old, target)
                record.drain_s = self.clock() - started
            self._enter(Phase.SWITCHING)
            await mechanism.hand_over(old if old != target else None, target)
            self._enter(Phase.VERIFYING)
            await self._verify(target)
        except SwitchFailed as failure:
            record.failed_step, record.error = failure.step, failure.message
            log.error(
                "switch %s -> %s (%s) failed at %s: %s; recovering", old, target, mechanism.name, failure.step, failure
            )
            self._enter(Phase.RECOVERING)
            serving = await self._recover_safely(old, target)
        except Exception as exc:  # a bug must not leave the gateway holding requests forever
            record.failed_step, record.error = "internal", repr(exc)
            log.exception("switch %s -> %s failed unexpectedly; recovering", old, target)
            self._enter(Phase.RECOVERING)
            serving = await self._recover_safely(old, target)
        else:
            serving = target
        finally:
            # Cancelled (shutdown): nothing to recover to; waiters are told by stop().
            record.duration_s = self.clock() - started
        record.mode_after = serving
        record.outcome = OK if serving == target else (FAILED if serving else UNAVAILABLE)
        self.cost = self.cost.observe(record.duration_s)
        self.switches += 1
        self.metrics.mode_switches.labels(mechanism.name, target, record.outcome).inc()
        self.metrics.switch_duration.observe(record.duration_s)
        if serving is None:
            self.mode = old or target
            self._last_recovery = self.clock()
            log.error("no mode serves after the failed switch to %s: answering 503 until one does", target)
            self._enter(Phase.UNAVAILABLE)
            return
        self._activate(serving)
        if record.outcome == OK:
            log.info("now serving %s mode (switch took %.3f s)", serving, record.duration_s)
        else:
            log.warning("switch to %s failed (%s); serving %s mode again", target, record.error, serving)

    async def _drain(self, old: str, target: str) -> int:
        """Wait for the old mode's requests, up to the drain deadline; then cut them. Returns how many were cut."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.drain_deadline
        while self.inflight(old) and loop.time() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        leases = list(self.leases[old])
        if not leases and not self.inflight(old):
            return 0
        reason = (
            f"the request was cut: the GPU set is switching from {old} to {target} mode and the drain deadline "
            f"({self.settings.drain_deadline:g} s) has passed"
        )
        for lease in leases:
            lease.cut(reason)
        self.metrics.switch_dropped.labels(CUT).inc(len(leases))
        log.warning("drain deadline passed: cut %d request(s) on %s mode", len(leases), old)
        grace = loop.time() + CUT_GRACE_S
        while self.inflight(old):
            if loop.time() >= grace:
                raise SwitchFailed("drain", f"{self.inflight(old)} request(s) on {old} mode did not end when cut")
            await asyncio.sleep(DRAIN_POLL_S)
        return len(leases)

    async def _verify(self, mode: str) -> None:
        await verify(self._client, self.urls[mode], self.settings.verify_timeout, self.headers[mode])

    async def _recover_safely(self, old: str | None, target: str) -> str | None:
        try:
            return await self._recover(old, target)
        except Exception:
            log.exception("recovery from the failed switch to %s failed unexpectedly", target)
            return None

    async def _recover(self, old: str | None, target: str) -> str | None:
        """After a failed switch, the first of these that verifies: old as it is, old restored, the target."""
        mechanism = self._mechanism
        candidates = [old] if old is not None and old != target else []
        for mode in candidates:
            with contextlib.suppress(SwitchFailed):
                await mechanism.wake(mode)
            try:
                await self._verify(mode)
                return mode
            except SwitchFailed as failure:
                log.warning("%s mode does not serve as it is (%s); restoring it", mode, failure)
            try:
                await mechanism.restore(mode, failed=target)
                await self._verify(mode)
                return mode
            except SwitchFailed as failure:
                log.error("%s mode could not be restored: %s", mode, failure)
        try:
            await self._verify(target)
            return target
        except SwitchFailed as failure:
            log.error("%s mode does not serve either: %s", target, failure)
        return None

    async def _recover_task(self, preferred: str, first: bool = False) -> None:
        """No switch in sight: find a mode that serves (preferred first) by a 1-token generation, else unavailable."""
        for mode in (preferred, PLAIN if preferred == SPECULATIVE else SPECULATIVE):
            try:
                await self._verify(mode)
            except SwitchFailed as failure:
                if first:
                    log.warning("%s mode does not serve: %s", mode, failure)
                continue
            if first or self.phase is Phase.UNAVAILABLE:
                log.info("serving %s mode", mode)
            self._activate(mode)
            return
        if first:
            log.error("neither mode serves at start-up: answering 503 until one does")
        self._last_recovery = self.clock()
        self._enter(Phase.UNAVAILABLE)
