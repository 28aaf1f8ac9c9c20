"""The two configurations of the model, said once: a pool's name, a time-shared GPU set's mode, a server's role.

from crossover.gateway.modes import MODES, PLAIN, SPECULATIVE, Mode, other
other(SPECULATIVE)  # "plain"
"""

from __future__ import annotations

import typing
from typing import Literal

Mode = Literal["speculative", "plain"]
MODES: tuple[Mode, ...] = typing.get_args(Mode)
SPECULATIVE, PLAIN = MODES


def other(mode: Mode) -> Mode:
    """The mode that is not `mode` (one GPU set holds one of the two at a time)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return PLAIN if mode == SPECULATIVE else SPECULATIVE
