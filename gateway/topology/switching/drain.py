"""The drain before a hand-over: the old mode's requests end by themselves, up to the drain deadline, then are cut.

    cut = await drain(old, target, leases, inflight=..., here=..., caught_up=..., deadline_s=30)

Replicas: it also waits until the others have seen the drain and published what they still have in flight; once
cut, only this replica's requests are waited for (the others cut theirs when they see the hand-over begin).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection
from typing import Protocol

from crossover.gateway.modes import Mode
from crossover.gateway.topology.switching.mechanisms import SwitchFailed

log = logging.getLogger("crossover.switching")

# Requests cut at the drain deadline must be gone within this long (their streams end at once).
CUT_GRACE_S = 5.0
DRAIN_POLL_S = 0.02


class Cuttable(Protocol):
    """A request's place on a mode (the controller's `Lease`): cut ends it."""

    def cut(self, reason: str) -> None: ...


async def drain(
    old: Mode,
    target: Mode,
    leases: Collection[Cuttable],
    *,
    inflight: Callable[[Mode], int],
    here: Callable[[], int],
    caught_up: Callable[[], bool],
    deadline_s: float,
) -> int:
    """Wait for `old`'s requests (`inflight(old)`: here and elsewhere) up to `deadline_s`, then cut this replica's
    (`leases`) and wait for them to end (`here()`); how many were cut. SwitchFailed if they do not end."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + deadline_s
    while (inflight(old) or not caught_up()) and loop.time() < deadline:
        await asyncio.sleep(DRAIN_POLL_S)
    cut = list(leases)
    if not cut and not inflight(old):
        return 0
    reason = (
        f"the request was cut: the GPU set is switching from {old} to {target} mode and the drain deadline "
        f"({deadline_s:g} s) has passed"
    )
    for lease in cut:
        lease.cut(reason)
    log.warning("drain deadline passed: cut %d request(s) on %s mode", len(cut), old)
    grace = loop.time() + CUT_GRACE_S
    while (left := here()) > 0:
        if loop.time() >= grace:
            raise SwitchFailed("drain", f"{left} request(s) on {old} mode did not end when cut")
        await asyncio.sleep(DRAIN_POLL_S)
    return len(cut)
