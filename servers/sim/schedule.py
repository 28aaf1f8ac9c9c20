"""Is the live stand-in keeping up with its own schedule? At a high --time-scale on a busy machine it cannot.

    tracker = ScheduleTracker(time_scale=100.0, now=loop.time())
    tracker.step_started(now, step_s / 100.0)     # each step is due step_s / time_scale after the last one
    tracker.step_done(now, clock)                 # clock: the engine's profile seconds after the step
    tracker.idle()                                # nothing to compute: no schedule to be behind
    tracker.report(now, clock)                    # {"time_scale", "lag_s", "max_lag_s", "speed_ratio", "lagging"}

A stand-in that falls behind does not fail: it runs slower, so its throughput (divided by the time scale) is
below its profile's - at 100x on two busy cores a sweep measured 47-65% of it, enough to hide a crossover.
So it says so: `lag_s` is how far (wall seconds) the step loop is behind the deadlines it would have kept
at full speed since it last had nothing to do; `speed_ratio` is simulated seconds advanced / (wall seconds x
time_scale) over the last SCHEDULE_WINDOW_S (1.0 keeps up; idle time counts as kept up); `lagging` turns on
below LAGGING_SPEED_RATIO and off again once the ratio has stayed at RECOVERED_SPEED_RATIO or above for a
whole window, with one log line each way (a stand-in on the edge does not log every few seconds).
Times are passed in, so the logic runs (and is tested) without a clock of its own.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

logger = logging.getLogger(__name__)

# Below this share of its schedule over the window, the stand-in's numbers are not its profile's.
LAGGING_SPEED_RATIO = 0.9
# Back above this, it keeps up again (apart from LAGGING_SPEED_RATIO, so a ratio near it does not flap).
RECOVERED_SPEED_RATIO = 0.95
# The recent window the speed ratio covers (wall seconds), and how often it is sampled.
SCHEDULE_WINDOW_S = 5.0
SCHEDULE_SAMPLE_S = 0.1
# Shorter spans are too noisy to judge (sleep overshoot, one long step): speed_ratio is 1.0 until then.
MIN_JUDGED_WINDOW_S = 1.0


class ScheduleTracker:
    def __init__(self, time_scale: float, *, now: float, clock: float = 0.0):
        self.time_scale = time_scale
        self.max_lag_s = 0.0
        self.lagging = False
        self._recovering_since: float | None = None
        # When the step in progress should end at full speed; None while idle (no schedule to keep).
        self._due: float | None = None
        self._samples: deque[tuple[float, float]] = deque([(now, clock)])

    def idle(self) -> None:
        self._due = None

    def step_started(self, now: float, wall_s: float) -> None:
        """A step of `wall_s` (profile duration / time scale) starts; it is due that long after the last one."""
        self._due = (now if self._due is None else self._due) + wall_s

    def step_done(self, now: float, clock: float) -> None:
        lag = self.lag_s(now)
        self.max_lag_s = max(self.max_lag_s, lag)
        if now - self._samples[-1][0] >= SCHEDULE_SAMPLE_S:
            self._observe(now, clock)

    def lag_s(self, now: float) -> float:
        return max(0.0, now - self._due) if self._due is not None else 0.0

    def speed_ratio(self, now: float, clock: float) -> float:
        samples = self._samples
        # The oldest sample still inside the window (or the newest one before it, so the span covers it).
        while len(samples) > 1 and now - samples[1][0] >= SCHEDULE_WINDOW_S:
            samples.popleft()
        then, clock_then = samples[0]
        span = now - then
        if span < MIN_JUDGED_WINDOW_S:
            return 1.0
        return (clock - clock_then) / (span * self.time_scale)

    def report(self, now: float, clock: float) -> dict[str, Any]:
        """The `/server_info` "schedule" block."""
        ratio = self._observe(now, clock)
        lag = self.lag_s(now)
        self.max_lag_s = max(self.max_lag_s, lag)
        return {
            "time_scale": self.time_scale,
            "lag_s": round(lag, 6),
            "max_lag_s": round(self.max_lag_s, 6),
            "speed_ratio": round(ratio, 4),
            "lagging": self.lagging,
        }

    def _observe(self, now: float, clock: float) -> float:
        if now > self._samples[-1][0]:
            self._samples.append((now, clock))
        ratio = self.speed_ratio(now, clock)
        if not self.lagging and ratio < LAGGING_SPEED_RATIO:
            self.lagging = True
            logger.warning(
                "the stand-in is falling behind its schedule: it advanced %.0f%% of the simulated time it should "
                "have over the last %.1f s at --time-scale %g (now %.2f s behind). Its throughput is below its "
                "profile's until it keeps up again: lower --time-scale or give it more CPU.",
                100 * ratio,
                SCHEDULE_WINDOW_S,
                self.time_scale,
                self.lag_s(now),
            )
        elif self.lagging:
            if ratio < RECOVERED_SPEED_RATIO:
                self._recovering_since = None
            elif self._recovering_since is None:
                self._recovering_since = now
            elif now - self._recovering_since >= SCHEDULE_WINDOW_S:
                self.lagging, self._recovering_since = False, None
                logger.warning("the stand-in keeps up with its schedule again (speed ratio %.2f)", ratio)
        return ratio
