"""A switch controller on a clock the test owns: set the load, move the clock, call `tick()`; no servers, no
sleeping. The run of a switch is not under test here: a switch the policy starts is over at once.

    ticking = TickingController(settings)
    ticking.step(t=1.0, load=40)     # -> the controller's decision at t
    ticking.switches                 # [(t, target, reason), ...]
"""

from __future__ import annotations

import httpx
from prometheus_client import CollectorRegistry

from crossover.gateway.admission import Admission
from crossover.gateway.backends.health import Breaker
from crossover.gateway.backends.pools import Pools
from crossover.gateway.config import Settings
from crossover.gateway.metrics import Metrics
from crossover.gateway.policies.switcher import SwitchDecision
from crossover.gateway.topology.routing import Routing
from crossover.gateway.topology.switching.controller import Phase, SwitchController


class _Instant(SwitchController):
    def __init__(self, *args, switches: list, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.started = switches

    def _begin(self, target, reason) -> None:
        self.started.append((self.clock(), target, reason))
        self.mode, self.mode_since = target, self.clock()


class TickingController:
    def __init__(self, settings: Settings) -> None:
        self.now = 0.0
        self.pools = Pools.from_settings(settings)
        routing = Routing.from_settings(settings)
        metrics = Metrics(CollectorRegistry(), self.pools, routing, Admission(10, 10, 1.0))
        self.switches: list[tuple[float, str, str]] = []
        self.controller = _Instant(
            settings,
            self.pools,
            routing,
            metrics,
            Breaker(self.pools, settings.health),
            httpx.AsyncClient(),  # never opened: the run of a switch is not under test
            switches=self.switches,
            clock=lambda: self.now,
        )
        self.controller.phase = Phase.ACTIVE
        self.controller.mode_since = 0.0
        for backend in self.pools.all():
            backend.healthy = True

    def step(self, t: float, load: int) -> SwitchDecision | None:
        self.now = t
        for backend in self.pools.all():
            backend.inflight = 0
        self.pools.pool(self.controller.mode)[0].inflight = load
        self.controller.tick()
        return self.controller.last_decision


def time_shared_settings(**switching) -> Settings:
    return Settings(
        topology="time-shared",
        threshold=switching.pop("threshold", 16),
        hysteresis=switching.pop("hysteresis", 8),
        pools={"speculative": {"backends": ["http://127.0.0.1:9"]}, "plain": {"backends": ["http://127.0.0.1:10"]}},
        switching={"mechanism": "sleep", "dwell": 30, "window": 10, "interval": 1, "initial_cost": 5, **switching},
    )
