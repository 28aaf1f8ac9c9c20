"""How far apart failed switch and recovery attempts of a time-shared GPU set are spaced.

backoff = Backoff(base=5.0, cap=300.0)
delay = backoff.failed(now)     # 5, then 10, 20 ... up to 300 s
backoff.ready(now)              # may the next attempt start?
backoff.succeeded()             # a mode serves again (or an operator asked): back to no wait
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class Backoff:
    """Capped exponential spacing of failed attempts: base, 2 x base, 4 x base ... up to `cap`."""

    base: float
    cap: float
    failures: int = 0
    next_at: float = -math.inf

    def failed(self, now: float) -> float:
        delay = min(self.cap, self.base * 2**self.failures)
        self.failures += 1
        self.next_at = now + delay
        return delay

    def succeeded(self) -> None:
        self.failures, self.next_at = 0, -math.inf

    def ready(self, now: float) -> bool:
        return now >= self.next_at

    def view(self, now: float) -> dict:
        return {
            "failures": self.failures,
            "next_attempt_in_s": round(max(0.0, self.next_at - now), 3) if self.failures else 0.0,
        }
