"""Replicas: of the gateways that share one time-shared GPU set, only the one that holds the cluster's lease acts on
it (decides, switches, recovers); the others follow the mode, phase and pin it publishes. A gateway alone always acts.

    replica = Replica(coordination, take_over=adopt, step_back=halt, clock=clock)   # in the controller's __init__
    replica.start()                   # with the controller: act at once if this replica holds the lease
    if replica.acts(): ...            # every tick: takes over or steps back as the lease came or went
    if replica.fenced(failure): ...   # a call on the GPU set was refused by its fence: stepped down
    replica.refused(record, failure, target)   # ... refused a switch: kept, if an operator's, to run again
    mode = replica.refused_again(serving)      # after a takeover: that switch, if recent and still to be made
    replica.acting                    # False: a follower; its controller mirrors what the leader publishes
    replica.mirror(controller, mode, phase, target, pinned)   # a follower: what its leader published

An operator's PUT /admin/mode reaches whichever replica it reaches: `ModeRequests` runs it on the leader, and on a
follower refuses what the leader would refuse or carries it to the leader, whose answer every replica shows.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from typing import Any, Protocol, TypeGuard

from crossover.gateway.cluster import Control, Coordination, ModeAnswer, ModeRequest
from crossover.gateway.engines import Fenced
from crossover.gateway.errors import GatewayError
from crossover.gateway.modes import Mode
from crossover.gateway.topology.switching.mechanisms import SwitchFailed
from crossover.gateway.topology.switching.record import FAILED, OPERATOR, Host, Phase, SwitchRecord

__all__ = ["FENCED_RETRY_S", "ModeRequests", "Replica"]

log = logging.getLogger("crossover.switching")

# An operator's switch the GPU set's fence refused runs again if this replica leads again within this long.
FENCED_RETRY_S = 30.0


class Replica:
    """Whether this replica acts on the GPU set, kept to the lease: `take_over` runs when it comes (adopt what
    really serves: a leader killed mid-switch leaves the GPU set anywhere, its target perhaps still starting - then
    that start is finished), `step_back` when it goes (end the switch under way where it is: the new leader adopts
    what it left)."""

    def __init__(
        self,
        coordination: Coordination,
        *,
        take_over: Callable[[], None],
        step_back: Callable[[], None],
        clock: Callable[[], float],
    ) -> None:
        self.coordination = coordination
        # This replica runs the switches (it held the lease when it last looked); a gateway alone always does.
        self.acting = coordination.leader
        self._take_over = take_over
        self._step_back = step_back
        self._clock = clock
        self._fenced_switch: tuple[Mode, float] | None = None  # an operator's switch the fence refused, and when

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

    def refused(self, record: SwitchRecord, failure: SwitchFailed, target: Mode) -> None:
        """The GPU set's fence refused the switch to `target` (`record`): this replica stepped down (`fenced`). An
        operator's switch is not lost silently: /admin/state says why it did not run, and this replica runs it again
        if it takes the lease back within FENCED_RETRY_S (it does at its next sync where the store had counted tokens
        lower than the GPU set accepted: coordination.py); else it was dropped, and says so."""
        record.failed_step, record.outcome = failure.step, FAILED
        record.error = f"refused by the GPU set's fence, this replica stepped down: {failure.message}"
        if record.reason == OPERATOR:
            self._fenced_switch = (target, self._clock())
            record.error += f"; run again if this replica leads again within {FENCED_RETRY_S:g} s, else dropped"
        log.warning("switch %s -> %s %s", record.from_mode, record.to_mode, record.error)

    def refused_again(self, serving: Mode | None) -> Mode | None:
        """After a takeover that found `serving`: the operator's switch the fence refused, if it is recent and still
        to be made (then the controller runs it); forgotten either way."""
        refused, self._fenced_switch = self._fenced_switch, None
        if refused is None:
            return None
        mode, at = refused
        if mode == serving or self._clock() - at > FENCED_RETRY_S:
            return None
        log.warning("the fence refused the operator's switch to %s; this replica leads again: running it", mode)
        return mode

    def mirror(self, host: Host, mode: Mode | None, phase: str | None, target: Mode | None, pinned: bool) -> None:
        """A follower: the leader published its mode, switch phase and pin. Requests are held while it switches,
        served on its mode when it is active; this replica's own requests on the old mode are cut once the leader
        has stopped draining (its hand-over would fail them anyway)."""
        if self.acting or phase is None:
            return
        host.pinned = pinned
        host.target = target
        new = Phase(phase)
        if new in (Phase.SWITCHING, Phase.VERIFYING, Phase.RECOVERING, Phase.UNAVAILABLE) and host.mode is not None:
            for lease in list(host.leases[host.mode]):
                lease.cut(f"the request was cut: the GPU set is leaving {host.mode} mode (phase {new})")
        if new is Phase.ACTIVE and mode is not None:
            host._activate(mode)
            return
        if mode is not None:
            host.mode = mode
        host._enter(new)


class Operated(Protocol):
    """The switch controller as PUT /admin/mode reaches it."""

    @property
    def adopting(self) -> bool: ...

    def request_switch(self, mode: Mode | None, *, pin: bool | None = None) -> bool: ...

    def check_request(self, mode: Mode | None) -> Mode | None: ...

    def operator_switched(self) -> None: ...

    def view(self) -> dict: ...


class ModeRequests:
    """PUT /admin/mode on any replica. The leader runs it. A follower refuses what the leader would refuse, as far as
    the phase it published tells (409 mid-switch, 429 too soon), and carries the rest to the leader in the shared
    state (202, with the request's id); the leader runs a carried request and publishes its answer, which
    /admin/state on every replica shows (`view`).

        requests = ModeRequests(controller, coordination)   # in the time-shared topology's __init__
        view, status = requests.put("plain", None)          # PUT /admin/mode on this replica
        control.model_copy(update=requests.published())     # what this replica shares
        requests.apply(control)                             # what the cluster shares, at every sync
    """

    def __init__(self, controller: Operated, coordination: Coordination) -> None:
        self.controller = controller
        self.coordination = coordination
        # The last PUT /admin/mode a follower carried to the leader, and the leader's answer: both shared.
        self.request: ModeRequest | None = None
        self.answer: ModeAnswer | None = None
        self.operator_switches = 0  # as the leader counts them (shared)
        self._joined = False  # has this replica applied the cluster's state yet (what it finds then is old news)

    def published(self) -> dict[str, Any]:
        return {"mode_request": self.request, "mode_answer": self.answer, "operator_switches": self.operator_switches}

    def put(self, mode: Mode | None, pin: bool | None) -> tuple[dict, int]:
        """202 while the switch runs (or the request is carried), 200 if the mode already serves (or only the pin
        changed on the leader); SwitchConflict or SwitchRateLimited as the controller's `request_switch`."""
        controller = self.controller
        if self.coordination.leader:
            started = controller.request_switch(mode, pin=pin)
            self.operator_switches += started
            return controller.view(), 202 if started else 200
        mode = controller.check_request(mode)
        if mode is None and pin is None:
            return controller.view(), 200  # it serves already
        if mode is not None:
            controller.operator_switched()
        self.request = ModeRequest(id=uuid.uuid4().hex, mode=mode, pin=pin, member=self.coordination.member)
        return {**controller.view(), "mode_request": self.view()}, 202

    def apply(self, control: Control) -> None:
        """The leader runs a follower's request and keeps its answer to publish; a follower takes the request and
        answer the leader published, and its operator changes (the rate limit holds on every replica alike)."""
        request = control.mode_request
        if not self.coordination.leader:
            if self._joined and control.operator_switches > self.operator_switches:
                self.controller.operator_switched()
            self.request, self.answer, self._joined = request, control.mode_answer, True
            self.operator_switches = control.operator_switches
            return
        self._joined = True
        if request is not None and answers(control.mode_answer, request):
            self.answer = control.mode_answer  # answered by the replica that led before this one took the lease
        if request is not None and not answers(self.answer, request):
            self.request = request
            if not self.controller.adopting:
                self.answer = self._run(request)
            # Else this replica has just taken the lease (or started) and is finding out what serves: nothing the
            # request could conflict with runs yet, so it waits for that (`adopted`) rather than being refused.

    def adopted(self) -> None:
        """The leader found what serves: a request that waited for it runs now."""
        request = self.request
        if self.coordination.leader and request is not None and not answers(self.answer, request):
            self.answer = self._run(request)

    def _run(self, request: ModeRequest) -> ModeAnswer:
        """A request carried from a follower, which found no switch under way when it took it: refused here only
        if one started meanwhile (or the rate limit says so). The refusal is not run later - the switch that won
        may have done what was asked, and an operator's intent is stale by then - but published for
        /admin/state on every replica and logged."""
        log.info(
            "running a PUT /admin/mode taken by %s (request %s): mode %s, pin %s",
            request.member or "another replica",
            request.id,
            request.mode,
            request.pin,
        )
        try:
            started = self.controller.request_switch(request.mode, pin=request.pin)
        except GatewayError as exc:
            log.warning("the PUT /admin/mode of %s (request %s) is refused: %s", request.member, request.id, exc)
            return ModeAnswer(id=request.id, status=exc.status, error=str(exc))
        self.operator_switches += started
        return ModeAnswer(id=request.id, status=202 if started else 200)

    def view(self) -> dict | None:
        """The last PUT /admin/mode a follower carried, and what the leader made of it (None: not yet answered)."""
        request, answer = self.request, self.answer
        if request is None:
            return None
        answered = answer.model_dump(exclude={"id"}) if answers(answer, request) else None
        return {**request.model_dump(), "answer": answered}


def answers(answer: ModeAnswer | None, request: ModeRequest) -> TypeGuard[ModeAnswer]:
    """`answer` is the one to `request`."""
    return answer is not None and answer.id == request.id
