"""Adoption at start-up, on taking the lease and while none serves: which mode of a time-shared GPU set really serves,
asked before anything is moved.

    serving, states = await find_serving(mechanism, initial="speculative")   # None: bring one up
    serving, _ = await find_serving(mechanism, "plain", asleep_too=False)   # recovery: what serves as it is
    starting = start_under_way(states)          # none serves: a mode whose start is under way, to wait for
    adoption = Adoption(controller, mechanism, replica, settings.switching, clock=clock, bring_up=recover)
    if await adoption.adopt(): ...              # the controller's adoption, as one run; True: a mode served as it is

What a mechanism believes before anything was seen is a presumption (which mode `servers up` left asleep):
only a generation says which mode serves. Modes believed serving are asked first, the configured one first
among equals; a dead, stopped or starting server is not asked.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from crossover.gateway.config import SwitchingSettings
from crossover.gateway.modes import MODES, Mode, other
from crossover.gateway.topology.switching.mechanisms import Mechanism, ModeState, SwitchFailed
from crossover.gateway.topology.switching.record import ADOPTED, RECOVERY, Host, Phase, SwitchRecord
from crossover.gateway.topology.switching.replicas import Replica

log = logging.getLogger("crossover.switching")


async def find_serving(
    mechanism: Mechanism, initial: Mode, *, asleep_too: bool = True
) -> tuple[Mode | None, dict[Mode, ModeState]]:
    """(the mode that verifies, or None; what the mechanism said of each mode). `asleep_too=False` (a recovery,
    where the gateway itself released the sleeping mode, so it knows): a generation is not sent to it."""
    states = {mode: await mechanism.mode_state(mode) for mode in MODES}
    order = sorted((initial, other(initial)), key=lambda mode: states[mode] is not ModeState.SERVING)
    skip = {ModeState.DEAD, ModeState.STOPPED, ModeState.STARTING} | (set() if asleep_too else {ModeState.ASLEEP})
    for mode in order:
        if states[mode] in skip:
            continue
        try:
            await mechanism.verify(mode)
        except SwitchFailed as failure:
            log.warning("%s mode does not serve: %s", mode, failure)
            continue
        return mode, states
    return None, states


def start_under_way(states: dict[Mode, ModeState]) -> Mode | None:
    """The mode whose start is under way, from what the mechanism said of each (`find_serving`'s states) when none
    serves: a leader lost mid-switch leaves its target so. Waiting for it is one start; bringing up the initial mode
    instead would stop it and start another."""
    starting = [mode for mode in MODES if states[mode] is ModeState.STARTING]
    return starting[0] if len(starting) == 1 else None


async def already_serving(mechanism: Mechanism, prefer: Mode) -> Mode | None:
    """A mode that serves as it is (it generates), `prefer` first; asked before anything is started or stopped, so a
    recovery never stops a server that serves. Never raises."""
    try:
        serving, _ = await find_serving(mechanism, prefer, asleep_too=False)
    except Exception:
        log.exception("looking for a mode that serves failed unexpectedly")
        return None
    return serving


class Adoption:
    """What the controller (`host`) serves at start-up, on taking the lease, and when a mode comes up by itself while
    none serves: the mode that really serves; else a start under way, finished; else `bring_up()` (a recovery)."""

    def __init__(
        self,
        host: Host,
        mechanism: Mechanism,
        replica: Replica,
        settings: SwitchingSettings,
        *,
        clock: Callable[[], float],
        bring_up: Callable[[], Awaitable[None]],
    ) -> None:
        self.host = host
        self.mechanism = mechanism
        self.replica = replica
        self.settings = settings
        self.clock = clock
        self.bring_up = bring_up

    async def adopt(self) -> bool:
        """Serve the mode that really serves (the initial one first); else finish a start under way (a leader lost
        mid-switch left its target starting); else bring one up. True if a mode served as it was."""
        serving, states = await find_serving(self.mechanism, self.settings.initial_mode)
        if serving is not None:
            log.info("serving %s mode (found serving at start-up)", serving)
            self.host._activate(serving)
            return True
        starting = start_under_way(states)
        if starting is not None and await self.finish_start(starting):
            return False
        log.warning("no mode serves at start-up (%s): bringing one up", ", ".join(f"{m} {states[m]}" for m in MODES))
        await self.bring_up()
        return False

    async def finish_start(self, mode: Mode) -> bool:
        """`mode` is starting and no mode serves: wait for that start (up to the mechanism's start-up time) and serve
        it, rather than stop it to bring the initial mode up (one switch would become two starts and two stops).
        False if it failed or timed out: then the caller recovers as from no serving mode."""
        host, mechanism = self.host, self.mechanism
        # A follower mirrored its leader's target: the agent's state is the truth, the published target says whose.
        whose = "the switch its last leader began" if host.target == mode else "a start begun before this replica acted"
        log.warning(
            "%s mode is starting (%s): waiting up to %g s for it, then serving it",
            mode,
            whose,
            self.settings.switch_timeout,
        )
        started = self.clock()
        record = SwitchRecord(None, mode, mechanism.name, ADOPTED)
        host.last_switch = record
        host.target = mode
        host._enter(Phase.SWITCHING)
        try:
            await mechanism.finish_start(mode)
            host._enter(Phase.VERIFYING)
            await mechanism.verify(mode)
        except SwitchFailed as failure:
            if self.replica.fenced(failure):
                return True  # stepped down: the replica that holds the lease adopts what serves
            log.error("the start of %s mode under way did not come up (%s): bringing a mode up", mode, failure)
            return False
        host._finish(record, mode, started)
        return True

    async def adopt_if_serving(self) -> None:
        """No mode serves: if one does by now, serve it (counted as a recovery)."""
        started = self.clock()
        serving = await already_serving(self.mechanism, self.settings.initial_mode)
        if serving is None or self.host.phase is not Phase.UNAVAILABLE:
            return
        log.warning("%s mode serves (it came up without the gateway): adopting it", serving)
        record = SwitchRecord(None, serving, self.mechanism.name, RECOVERY)
        self.host.last_switch = record
        self.host.recoveries += 1
        self.host._finish(record, serving, started)
