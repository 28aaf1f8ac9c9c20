"""Adoption at start-up: which mode of a time-shared GPU set really serves, asked before anything is moved.

    serving, states = await find_serving(mechanism, initial="speculative")   # None: bring one up

What a mechanism believes before anything was seen is a presumption (which mode `servers up` left asleep):
only a generation says which mode serves. Modes believed serving are asked first, the configured one first
among equals; a dead or stopped server is not asked.
"""

from __future__ import annotations

import logging

from crossover.gateway.modes import MODES, Mode, other
from crossover.gateway.switch_mechanisms import Mechanism, ModeState, SwitchFailed

log = logging.getLogger("crossover.switching")


async def find_serving(mechanism: Mechanism, initial: Mode) -> tuple[Mode | None, dict[Mode, ModeState]]:
    """(the mode that verifies, or None; what the mechanism said of each mode)."""
    states = {mode: await mechanism.mode_state(mode) for mode in MODES}
    order = sorted((initial, other(initial)), key=lambda mode: states[mode] is not ModeState.SERVING)
    for mode in order:
        if states[mode] in (ModeState.DEAD, ModeState.STOPPED):
            continue
        try:
            await mechanism.verify(mode)
        except SwitchFailed as failure:
            log.warning("%s mode does not serve: %s", mode, failure)
            continue
        return mode, states
    return None, states
