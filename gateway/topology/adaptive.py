"""The adaptive controller: every window, the threshold moves toward the crossover predicted at the live acceptance.

    adaptive = AdaptiveController(settings.adaptive, pools, routing, metrics, topology)   # app.py's build_state
    await adaptive.start() ... await adaptive.stop()      # the app's lifespan, after the topology starts
    adaptive.pause("PUT /admin/threshold")                # an operator's threshold wins until ...
    adaptive.resume()                                     # ... PUT /admin/adaptive {"enabled": true}

The decision is gateway/policies/adaptive.py's (pure: the replay can step it too), every `window` seconds, and at
once (it looks every ADAPTIVE_LOOK_S) when the acceptance moved by `react` since its last decision; this module reads
its inputs (the speculative backends' acceptance as the load scrape last read it, the live threshold), and moves the
threshold where PUT /admin/threshold moves it: `Routing.update`, then the topology (in-engine: every gate;
time-shared: the switch threshold, its cost guard unchanged), then the cluster's store, so every replica serves the
move. Only where
the threshold is moved today does it act: the process holding the cluster's lease (`coordination.leader`: one
process alone always does). It holds while paused; the pause is the cluster's (`Control.adaptive_paused`), so an
operator's PUT on any replica pauses the leader's controller.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Iterator

from prometheus_client import Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from crossover.gateway.backends import Pools, level_bounds
from crossover.gateway.config import ADAPTIVE_LOOK_S, PLAIN, SPECULATIVE, AdaptiveSettings, Mode, ThresholdError
from crossover.gateway.errors import GatewayError
from crossover.gateway.metrics import Metrics
from crossover.gateway.policies import (
    DIRECTIONS,
    EXPLORE_ARMS,
    EXPLORE_DISAGREES,
    AdaptiveDecision,
    BenchTable,
    Correction,
    ExploreArm,
    decide_threshold,
    explore_verdict,
    level_load,
    mean_acceptance,
)
from crossover.gateway.topology.interface import THRESHOLD, Topology
from crossover.gateway.topology.routing import Routing

log = logging.getLogger("crossover.adaptive")

# What a window added at one level of one pool: (pool, level low, high, requests, tokens, request-seconds).
Delta = tuple[Mode, int, int | None, float, float, float]

# Moves kept for /admin/state and tests (the log and the counter have them all).
KEPT_MOVES = 64


class AdaptiveController:
    """Reads the acceptance, asks `decide_threshold`, and moves the threshold the way an operator's PUT does."""

    def __init__(
        self, settings: AdaptiveSettings, pools: Pools, routing: Routing, metrics: Metrics, topology: Topology
    ) -> None:
        self.settings = settings
        self.pools = pools
        self.routing = routing
        self.topology = topology
        self.limits = settings.limits()
        self.table: BenchTable | None = settings.bench_table() if settings.enabled else None
        self.windows = 0  # windows passed since start (deciding or not)
        self.early = 0  # decisions taken before a window's end, the acceptance having moved by `react`
        self.last: AdaptiveDecision | None = None
        self.moves: deque[tuple[float, AdaptiveDecision]] = deque(maxlen=KEPT_MOVES)
        self.moved = dict.fromkeys(DIRECTIONS, 0)  # as crossover_adaptive_moves_total counts them
        self.paused_why: str | None = None
        self.correction = Correction()
        # Explore (settings.explore): the threshold the decisions move, the arm served this window, each arm's
        # evidence, and why it holds (None: it does not).
        self.center: int | None = None
        self.arm: str | None = None
        self.arms = {name: ExploreArm() for name in EXPLORE_ARMS}
        self.holding: str | None = None
        self._arm_since = time.monotonic()
        # The rate table's sums (requests, tokens, seconds) by pool and level at the last window: each window adds
        # what ended since to the correction.
        self._seen: dict[str, list[tuple[float, float, float]]] = {}
        self._task: asyncio.Task | None = None
        self.moves_total = Counter(
            "crossover_adaptive_moves",
            "Threshold moves by the adaptive controller, by direction.",
            ["direction"],
            registry=metrics.registry,
        )
        for direction in DIRECTIONS:
            self.moves_total.labels(direction)
        metrics.registry.register(AdaptiveCollector(self))

    # -- lifespan -------------------------------------------------------------------------------

    async def start(self) -> None:
        if not self.settings.enabled:
            return
        if self.table is None:
            log.warning("[adaptive] is enabled without a table: the threshold holds (set adaptive.table)")
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        window = self.settings.window
        look = min(window, ADAPTIVE_LOOK_S)
        last = time.monotonic()
        while True:
            await asyncio.sleep(look)
            now = time.monotonic()
            reacting = now - last < window - look / 2
            if reacting and (self.exploring or not self.acceptance_moved()):  # explore keeps whole windows
                continue
            last = now
            try:
                await self.step(early=reacting)
            except Exception:  # one bad window must not end the controller
                log.exception("the adaptive controller's window failed; the threshold holds")

    def acceptance_moved(self) -> bool:
        """The acceptance is `react` or more away from the one the last decision took (decide now, not at the
        window's end)."""
        last = self.last
        now = self.acceptance()
        if last is None or last.accept_length is None or now is None:
            return False
        return abs(now - last.accept_length) >= self.settings.react

    # -- one window -----------------------------------------------------------------------------

    def acceptance(self) -> float | None:
        """The mean accept length over the speculative backends that report one (fresh readings only)."""
        return mean_acceptance(self.pools.accept_length(backend) for backend in self.pools.pool(SPECULATIVE))

    async def step(self, *, early: bool = False) -> AdaptiveDecision | None:
        """One window (`early`: a decision before the window's end, the acceptance having moved): None where this
        process does not decide (a follower, or paused)."""
        self.windows += 1  # every window, deciding or not: what a wait on "a window passed" reads
        if not self.topology.coordination.leader or self.paused:
            return None
        self.early += early
        accept = self.acceptance()
        deltas = self.deltas()
        if self.exploring and not early:
            self.explored(deltas, accept)
        self.correct(deltas, accept)
        if self.exploring:
            return await self._explore_step(accept)
        decision = decide_threshold(self.routing.threshold, accept, self.table, self.limits, self.correction)
        self.last = decision
        before = self.routing.adaptive_shared
        if decision.moved:
            self.moves.append((time.time(), decision))
            self.routing.adaptive_shared = self.shared()
            await self._move(decision)  # shares it with the move
        elif before is None or (before["target"], before["reason"]) != (decision.target, decision.reason):
            self.routing.adaptive_shared = self.shared()
            await self._share()
        return decision

    def shared(self) -> dict:
        """What every replica shows of the leader's decisions (Control.adaptive): its last decision and move."""
        last = self.last
        moved = self.moves[-1] if self.moves else None
        return {
            "target": None if last is None else last.target,
            "reason": None if last is None else last.reason,
            "last_decision": None if last is None else last.view(),
            "last_move": None if moved is None else {"at": moved[0], **moved[1].view()},
            "moves": dict(self.moved),
        }

    async def _share(self) -> None:
        try:
            await self.topology.share()
        except GatewayError as exc:
            log.warning("adaptive: %s", exc)

    def deltas(self) -> list[Delta]:
        """What the live rate table gained since the last window: (pool, level low, high, requests, tokens,
        request-seconds) of each level that saw a request end. Off the request path: a window's few sums."""
        out: list[Delta] = []
        pools: tuple[Mode, ...] = (SPECULATIVE, PLAIN)
        for pool in pools:
            now = self.pools.rates.by_level(pool)
            before = self._seen.get(pool)
            self._seen[pool] = now
            if before is None:
                continue
            for bucket, (sums, last) in enumerate(zip(now, before, strict=True)):
                requests, tokens, seconds = (a - b for a, b in zip(sums, last, strict=True))
                if requests > 0:
                    out.append((pool, *level_bounds(bucket), requests, tokens, seconds))
        return out

    def correct(self, deltas: list[Delta], accept: float | None) -> None:
        """Add a window's `deltas` to the correction, against the model at `accept` (the speculative pool only with
        one)."""
        if self.table is None or not self.settings.correct:
            return
        rates = self.table.rates if accept is None else self.table.speculative_at(accept)
        for pool, low, high, requests, tokens, seconds in deltas:
            if pool == SPECULATIVE and accept is None:
                continue
            rate = rates.throughput(pool, level_load(low, high))
            self.correction.observe(pool, low, high, requests, tokens, seconds, rate)

    # -- explore: switchback windows at the threshold + and - delta -----------------------------

    @property
    def exploring(self) -> bool:
        return self.settings.explore and self.table is not None

    def explored(self, deltas: list[Delta], accept: float | None) -> None:
        """The window just ended served the arm `self.arm`: its tokens against the model's (corrected, as the
        controller acts on it) for the same request-seconds at each pool and level, with the interval's ends."""
        table, arm = self.table, self.arm
        now = time.monotonic()
        seconds, self._arm_since = now - self._arm_since, now
        if table is None or arm is None or accept is None or not deltas:
            return

        def curves(rates=None):
            return self.correction.apply(table.speculative_at(accept, rates))

        model = curves()
        ends = (curves(table.low), curves(table.high)) if table.low is not None and table.high is not None else None
        realized = predicted = low = high = 0.0
        for pool, level_low, level_high, _, tokens, request_seconds in deltas:
            load = level_load(level_low, level_high)
            realized += tokens
            predicted += request_seconds * model.throughput(pool, load) / load
            if ends is not None:
                a, b = (request_seconds * end.throughput(pool, load) / load for end in ends)
                low, high = low + min(a, b), high + max(a, b)
        if ends is None:
            low = high = predicted
        self.arms[arm].add(seconds, realized, predicted, low, high)

    async def _explore_step(self, accept: float | None) -> AdaptiveDecision:
        """The center moves as `decide` says, unless an arm's realized tokens left its interval (then it holds, and
        serves the center); the next window serves the other arm."""
        why = explore_verdict(self.arms)
        center = self.center if self.center is not None else self.routing.threshold
        if why is not None:
            if self.holding is None:
                log.warning("adaptive: %s", why)
            self.holding = why
            decision = AdaptiveDecision(center, center, EXPLORE_DISAGREES, accept)
            self.arm = None
            served = center
        else:
            decision = decide_threshold(center, accept, self.table, self.limits, self.correction)
            if decision.moved:
                self.moves.append((time.time(), decision))
                self.moves_total.labels(decision.direction).inc()  # type: ignore[arg-type]
                self.moved[decision.direction] += 1  # type: ignore[index]
            center = decision.threshold
            self.arm = EXPLORE_ARMS[1] if self.arm == EXPLORE_ARMS[0] else EXPLORE_ARMS[0]
            delta = self.settings.explore_delta if self.arm == EXPLORE_ARMS[0] else -self.settings.explore_delta
            served = min(max(center + delta, self.limits.minimum), self.limits.maximum)
        self.center, self.last = center, decision
        self.routing.adaptive_shared = self.shared()
        if served != self.routing.threshold:
            await self._apply(served)
        else:
            await self._share()
        return decision

    async def _apply(self, threshold: int) -> None:
        """Serve `threshold` as a PUT does (everywhere), logged and shared; a failure holds the one serving."""
        try:
            self.routing.update(threshold=threshold)
        except ThresholdError as exc:
            log.error("adaptive: the threshold %d does not apply: %s", threshold, exc)
            return
        except OSError:
            pass  # live, not saved: Routing said so (state_file_problem)
        try:
            await self.topology.threshold_changed({THRESHOLD})
        except GatewayError as exc:
            log.warning("adaptive: the threshold %d is live, but not everywhere yet: %s", threshold, exc)
        await self._share()

    def explore_view(self) -> dict | None:
        if not self.settings.explore:
            return None
        return {
            "delta": self.settings.explore_delta,
            "center": self.center,
            "arm": self.arm,
            "holding": self.holding is not None,
            "why": self.holding,
            "arms": {name: arm.view() for name, arm in self.arms.items()},
        }

    async def _move(self, decision: AdaptiveDecision) -> None:
        try:
            self.routing.update(threshold=decision.threshold)
        except ThresholdError as exc:
            log.error("the adaptive move %d -> %d does not apply: %s", decision.previous, decision.threshold, exc)
            self.moves.pop()
            self.routing.adaptive_shared = self.shared()
            return
        except OSError:
            pass  # live, not saved: Routing said so (state_file_problem)
        assert decision.direction is not None
        self.moves_total.labels(decision.direction).inc()
        self.moved[decision.direction] += 1
        self.routing.adaptive_shared = self.shared()  # with the count
        prediction = decision.prediction
        interval = None if prediction is None else prediction.interval
        log.info(
            "adaptive: threshold %d -> %d (predicted crossover %s, interval %s, accept length %.3f vs the bench's "
            "%.3f): %s",
            decision.previous,
            decision.threshold,
            "unknown" if prediction is None else f"{prediction.crossover:.1f}",
            "none" if interval is None else f"{interval[0]:.1f}-{interval[1]:.1f}",
            decision.accept_length or 0.0,
            self.table.accept_length if self.table is not None else 0.0,
            decision.reason,
        )
        try:
            await self.topology.threshold_changed({THRESHOLD})
        except GatewayError as exc:
            log.warning("adaptive: the threshold %d is live, but not everywhere yet: %s", decision.threshold, exc)
        await self._share()

    # -- the operator ---------------------------------------------------------------------------

    @property
    def paused(self) -> bool:
        return self.routing.adaptive_paused

    def pause(self, why: str) -> None:
        """An operator's threshold wins: nothing moves until `resume` (shared with the next `topology.share()`)."""
        if not self.settings.enabled or self.paused:
            return
        self.routing.adaptive_paused, self.paused_why = True, why
        log.info("adaptive: paused (%s) at threshold %d", why, self.routing.threshold)

    def resume(self) -> None:
        if self.paused or self.holding is not None:
            log.info("adaptive: resumed at threshold %d", self.routing.threshold)
        self.routing.adaptive_paused, self.paused_why = False, None
        # Explore starts over from the threshold serving now.
        self.center, self.arm, self.holding = None, None, None
        self.arms = {name: ExploreArm() for name in EXPLORE_ARMS}

    # -- views ----------------------------------------------------------------------------------

    def view(self) -> dict:
        """/admin/state's `adaptive`: the settings, the inputs, the last decision and the last move, and why."""
        settings = self.settings
        leading = self.topology.coordination.leader
        # A follower shows the leader's decisions, as the cluster's state last carried them.
        mine = self.shared() if leading or self.routing.adaptive_shared is None else self.routing.adaptive_shared
        return {
            "enabled": settings.enabled,
            "paused": self.paused,
            "paused_why": self.paused_why if self.paused else None,
            "deciding": settings.enabled and leading,
            "from_leader": not leading and self.routing.adaptive_shared is not None,
            "window_s": settings.window,
            "max_step": settings.max_step,
            "min": settings.min,
            "max": settings.max,
            "deadband": settings.deadband,
            "max_levels": settings.max_levels,
            "react": settings.react,
            "table": None if settings.table is None else str(settings.table),
            "bench_accept_length": None if self.table is None else self.table.accept_length,
            "accept_length": self.acceptance(),
            "windows": self.windows,
            "early_decisions": self.early,
            "moves": mine["moves"],
            "last_decision": mine["last_decision"],
            "last_move": mine["last_move"],
            "correction": {
                "on": settings.correct,
                "prior_requests": self.correction.prior,
                "levels": self.correction.view(),
            },
            "explore": self.explore_view(),
        }


class AdaptiveCollector(Collector):
    """The adaptive controller's last inputs and prediction, at scrape time (only once it has decided)."""

    def __init__(self, controller: AdaptiveController) -> None:
        self.controller = controller

    def collect(self) -> Iterator[Metric]:
        last = self.controller.last
        predicted = GaugeMetricFamily(
            "crossover_adaptive_predicted_crossover",
            "The crossover concurrency the adaptive controller predicted at its last window, from the bench table at "
            "the live acceptance.",
        )
        accept = GaugeMetricFamily(
            "crossover_adaptive_accept_length",
            "The speculative backends' mean accept length the adaptive controller read at its last window.",
        )
        if last is not None and last.prediction is not None:
            predicted.add_metric([], last.prediction.crossover)
        if last is not None and last.accept_length is not None:
            accept.add_metric([], last.accept_length)
        yield predicted
        yield accept
