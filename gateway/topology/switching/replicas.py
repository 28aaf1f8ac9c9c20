"""Replicas: of the gateways that share one time-shared GPU set, only the one that holds the cluster's lease acts on
it (decides, switches, recovers); the others follow the mode, phase and pin it publishes. A gateway alone always acts.

    replica = Replica(coordination, take_over=adopt, step_back=halt)   # in the switch controller's __init__
    replica.start()                   # with the controller: act at once if this replica holds the lease
    if replica.acts(): ...            # every tick: takes over or steps back as the lease came or went
    if replica.fenced(failure): ...   # a call on the GPU set was refused by its fence: stepped down
    replica.acting                    # False: a follower; its controller mirrors what the leader publishes
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from crossover.gateway.cluster import Coordination
from crossover.gateway.engines import Fenced

__all__ = ["Replica"]

log = logging.getLogger("crossover.switching")


class Replica:
    """Whether this replica acts on the GPU set, kept to the lease: `take_over` runs when it comes (adopt what
    really serves: a leader killed mid-switch leaves the GPU set anywhere, its target perhaps still starting - then
    that start is finished), `step_back` when it goes (end the switch under way where it is: the new leader adopts
    what it left)."""

    def __init__(
        self, coordination: Coordination, *, take_over: Callable[[], None], step_back: Callable[[], None]
    ) -> None:
        self.coordination = coordination
        # This replica runs the switches (it held the lease when it last looked); a gateway alone always does.
        self.acting = coordination.leader
        self._take_over = take_over
        self._step_back = step_back

    def start(self) -> None:
        if self.coordination.leader:
            self.take_over()
        else:
            self.acting = False  # a follower until its first tick finds it holds the lease

    def acts(self) -> bool:
        """Whether this replica may start a switch now (asked every tick): it has acted since before this tick, and
        the other replicas see the state it would switch on. Takes over or steps back as the lease came or went."""
        if not self.coordination.leader:
            if self.acting:
                self.step_back()
            return False
        if not self.acting:
            self.take_over()
            return False
        return self.coordination.connected

    def take_over(self) -> None:
        log.info("acting on the GPU set (this replica holds the lease)")
        self.acting = True
        self._take_over()

    def step_back(self) -> None:
        log.warning("no longer acting on the GPU set (the lease is lost); following the replica that holds it")
        self.acting = False
        self._step_back()

    def fenced(self, failure: Exception) -> bool:
        """Whether `failure` is a fence's refusal: another replica holds the lease now. Then this one steps down and
        tries nothing more (every call would be refused alike); the one that holds it adopts what serves, and this
        one follows it."""
        if not isinstance(failure, Fenced):
            return False
        log.error("a call on the GPU set was refused by its fence (%s): stepping down", failure)
        self.coordination.step_down(str(failure), failure.highest)
        self.acting = False
        return True
