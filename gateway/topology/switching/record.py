"""One switch (or recovery) as it runs and ran: its phases, its record (for /admin/state, the logs and the metrics),
and `Host`, the switch controller as the jobs beside it (adoption, recovery, a follower's mirror) move it."""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

from crossover.gateway.modes import Mode
from crossover.gateway.topology.switching.drain import Cuttable

log = logging.getLogger("crossover.switching")


class Phase(StrEnum):
    STARTING = "starting"
    ACTIVE = "active"
    DRAINING = "draining"
    SWITCHING = "switching"
    VERIFYING = "verifying"
    RECOVERING = "recovering"
    UNAVAILABLE = "unavailable"


# Outcomes (the `outcome` label of crossover_mode_switches_total).
OK = "ok"
FAILED = "failed"  # the switch failed (or could not start); the gateway serves a mode again (usually the old one)
UNAVAILABLE = "unavailable"  # the switch failed and no mode serves: 503s until one does

# Reasons a switch starts besides the policy's.
OPERATOR = "operator"
RECOVERY = "recovery"  # the serving mode died (or none served): brought up without an operator
STARTUP = "startup"
# A switch whose target was starting when this replica took the lease (a leader lost mid-switch): finished, not undone.
ADOPTED = "adopted"


@dataclass
class SwitchRecord:
    """One switch (or recovery), for /admin/state and the logs."""

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

    @property
    def seconds(self) -> float:
        """How long it took (0 until it ended)."""
        return self.duration_s or 0.0

    def ended(self, serving: str | None, seconds: float) -> None:
        """It ended with `serving` the mode that serves (None: none does)."""
        self.duration_s = seconds
        self.mode_after = serving
        self.outcome = OK if serving == self.to_mode else (FAILED if serving else UNAVAILABLE)

    def log_end(self) -> None:
        if self.mode_after is None:
            what = "recovery" if self.reason == RECOVERY else "switch"
            log.error(
                "no mode serves after the %s to %s: answering 503 until one does (retried by itself)",
                what,
                self.to_mode,
            )
        elif self.outcome == OK:
            log.info("now serving %s mode (%s took %.3f s)", self.mode_after, self.reason, self.seconds)
        else:
            log.warning("switch to %s failed (%s); serving %s mode again", self.to_mode, self.error, self.mode_after)

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


class Host(Protocol):
    """The switch controller as adoption, recovery and a follower's mirror move it: what serves and what is under
    way, the switch it shows, and the steps every run takes. The underscored three are the switching package's own
    (asyncio's transports call their loop's `_add_reader` alike): nothing outside the package calls them."""

    mode: Mode | None
    phase: Phase
    target: Mode | None
    pinned: bool
    last_switch: SwitchRecord | None
    recoveries: int

    @property
    def leases(self) -> Mapping[Mode, Collection[Cuttable]]: ...

    def _enter(self, phase: Phase) -> None: ...

    def _activate(self, mode: Mode) -> None:
        """Serve `mode` from now on."""

    def _finish(self, record: SwitchRecord, serving: Mode | None, started: float) -> None:
        """Account for a run that ended, and serve what serves (None: none does)."""
