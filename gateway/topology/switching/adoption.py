"""Adoption at start-up: which mode of a time-shared GPU set really serves, asked before anything is moved.

    serving, states = await find_serving(mechanism, initial="speculative")   # None: bring one up
    serving, _ = await find_serving(mechanism, "plain", asleep_too=False)   # recovery: what serves as it is
    starting = start_under_way(states)          # none serves: a mode whose start is under way, to wait for

What a mechanism believes before anything was seen is a presumption (which mode `servers up` left asleep):
only a generation says which mode serves. Modes believed serving are asked first, the configured one first
among equals; a dead, stopped or starting server is not asked.
"""

from __future__ import annotations

import logging

from crossover.gateway.modes import MODES, Mode, other
from crossover.gateway.topology.switching.mechanisms import Mechanism, ModeState, SwitchFailed

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
