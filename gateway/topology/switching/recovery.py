"""Self-healing of a time-shared GPU set: when the serving mode counts as dead, and how a mode is brought back.

    watch = ServingWatch(dead_after_s=3 * health_interval)
    watch.dead(now, pools.pool(mode))               # no usable backend for dead_after_s: recover
    serving = await after_failed_switch(mechanism, old, target)   # the first mode that verifies, or None
    await bring_up(mechanism, mode)                 # one mode from nothing (start-up, or the serving one died)
    serving = await bring_up_first(mechanism, order, record, trying=...)   # the first of `order` that comes up
    recovery = Recovery(controller, mechanism, replica, pools, breaker, watch, initial="speculative", clock=clock)
    await recovery.run(dead="plain")                # the controller's recovery, as one run: shown, then finished

The switch controller (gateway/topology/switching/controller.py) decides when to run a recovery; it accounts for it
(`Host._finish`). Nothing here drains or holds requests.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Sequence

from crossover.gateway.backends import Backend, Breaker, Pools
from crossover.gateway.modes import Mode, other
from crossover.gateway.topology.switching.adoption import already_serving
from crossover.gateway.topology.switching.mechanisms import Fenced, Mechanism, SwitchFailed
from crossover.gateway.topology.switching.record import RECOVERY, Host, Phase, SwitchRecord
from crossover.gateway.topology.switching.replicas import Replica

log = logging.getLogger("crossover.switching")


class ServingWatch:
    """Whether the serving mode has had no usable backend for `dead_after_s`."""

    def __init__(self, dead_after_s: float) -> None:
        self.dead_after_s = dead_after_s
        self.dead_since: float | None = None

    def dead(self, now: float, mode: Mode, backends: Iterable[Backend]) -> bool:
        if any(backend.usable for backend in backends):
            self.dead_since = None
            return False
        if self.dead_since is None:
            self.dead_since = now
            log.warning("%s mode has no usable backend: recovering if it stays so", mode)
        return now - self.dead_since >= self.dead_after_s

    def reset(self) -> None:
        self.dead_since = None


async def after_failed_switch(mechanism: Mechanism, old: Mode | None, target: Mode) -> Mode | None:
    """After a failed switch, the first of these that verifies: old as it is, old restored, the target. Never
    raises: a bug here must not leave the gateway holding requests forever."""
    try:
        return await _first_serving(mechanism, old, target)
    except Exception:
        log.exception("recovery from the failed switch to %s failed unexpectedly", target)
        return None


async def _first_serving(mechanism: Mechanism, old: Mode | None, target: Mode) -> Mode | None:
    candidates = [old] if old is not None and old != target else []
    for mode in candidates:
        with contextlib.suppress(SwitchFailed):
            await mechanism.wake(mode)
        try:
            await mechanism.verify(mode)
            return mode
        except SwitchFailed as failure:
            log.warning("%s mode does not serve as it is (%s); restoring it", mode, failure)
        try:
            await mechanism.restore(mode, failed=target)
            await mechanism.verify(mode)
            return mode
        except SwitchFailed as failure:
            log.error("%s mode could not be restored: %s", mode, failure)
    try:
        await mechanism.verify(target)
        return target
    except SwitchFailed as failure:
        log.error("%s mode does not serve either: %s", target, failure)
    return None


async def bring_up(mechanism: Mechanism, mode: Mode) -> None:
    """Bring `mode` up with nothing to drain or release, and verify it; SwitchFailed names the step that failed."""
    await mechanism.preflight(None, mode)
    await mechanism.hand_over(None, mode)
    await mechanism.verify(mode)


async def bring_up_first(
    mechanism: Mechanism, order: Sequence[Mode], record: SwitchRecord, *, trying: Callable[[Mode], None]
) -> Mode | None:
    """Bring up the first of `order` that comes up (`trying(mode)` as each is tried; `record` says what failed last):
    the mode that serves, or None. A fence's refusal ends it (`SwitchFailed`, raised: no other mode would be let
    through either)."""
    for mode in order:
        record.to_mode = mode
        trying(mode)
        try:
            await bring_up(mechanism, mode)
        except SwitchFailed as failure:
            if isinstance(failure, Fenced):
                raise
            record.failed_step, record.error = failure.step, failure.message
            log.error("recovery: %s mode does not come up: %s", mode, failure)
            continue
        except Exception as exc:  # a bug must not leave the gateway holding requests forever
            record.failed_step, record.error = "internal", repr(exc)
            log.exception("recovery: bringing %s mode up failed unexpectedly", mode)
            continue
        record.failed_step = record.error = None
        return mode
    return None


class Recovery:
    """The serving mode died, or none serves: bring up whichever mode can serve soonest, as one run of the controller
    (`host`): shown in /admin/state while it runs (phase `recovering`, its target), accounted for when it ends."""

    def __init__(
        self,
        host: Host,
        mechanism: Mechanism,
        replica: Replica,
        pools: Pools,
        breaker: Breaker,
        watch: ServingWatch,
        *,
        initial: Mode,
        clock: Callable[[], float],
    ) -> None:
        self.host = host
        self.mechanism = mechanism
        self.replica = replica
        self.pools = pools
        self.breaker = breaker
        self.watch = watch
        self.initial = initial
        self.clock = clock

    async def run(self, dead: Mode | None, reason: str = RECOVERY) -> None:
        host, mechanism = self.host, self.mechanism
        # Nothing known to have died (start-up, or no mode served): the configured mode first.
        order = mechanism.recovery_order(dead) if dead is not None else (self.initial, other(self.initial))
        started = self.clock()
        record = SwitchRecord(None, order[0], mechanism.name, reason)
        host.last_switch = record
        if dead is not None:
            host.recoveries += 1
            log.error(
                "%s mode has had no usable backend for %.3g s: recovering without an operator (trying %s)",
                dead,
                self.clock() - (self.watch.dead_since or started),
                ", then ".join(order),
            )
        host.target = order[0]
        host._enter(Phase.RECOVERING)
        for backend in self.pools.pool(dead) if dead is not None else ():
            self.breaker.rest(backend)
        # First a mode that already serves: starting one would stop it (one GPU set).
        serving = await already_serving(mechanism, order[0])
        if serving is not None:
            log.warning("recovery: %s mode already serves: adopting it (nothing started or stopped)", serving)
            record.to_mode = serving
            host._finish(record, serving, started)
            return
        try:
            serving = await bring_up_first(mechanism, order, record, trying=self._trying)
        except Fenced as failure:  # the only failure it raises: no other mode would be let through either
            self.replica.fenced(failure)
            return
        host._finish(record, serving, started)

    def _trying(self, mode: Mode) -> None:
        self.host.target = mode
