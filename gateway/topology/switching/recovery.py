"""Self-healing of a time-shared GPU set: when the serving mode counts as dead, and how a mode is brought back.

    watch = ServingWatch(dead_after_s=3 * health_interval)
    watch.dead(now, pools.pool(mode))               # no usable backend for dead_after_s: recover
    serving = await after_failed_switch(mechanism, old, target)   # the first mode that verifies, or None
    await bring_up(mechanism, mode)                 # one mode from nothing (start-up, or the serving one died)
    serving = await bring_up_first(mechanism, order, record, trying=...)   # the first of `order` that comes up

The switch controller (gateway/topology/switching/controller.py) decides when to call these and accounts for them;
nothing here drains, holds requests or counts.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Sequence

from crossover.gateway.backends import Backend
from crossover.gateway.modes import Mode
from crossover.gateway.topology.switching.mechanisms import Fenced, Mechanism, SwitchFailed
from crossover.gateway.topology.switching.record import SwitchRecord

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
