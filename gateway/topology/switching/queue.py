"""The switch queue: requests that arrive while a time-shared GPU set changes mode wait here, bounded.

    queue = SwitchQueue(max_waiting=1024, timeout=600.0)
    await queue.wait(lambda: controller.serving, describe)   # returns once a mode serves, else SwitchUnavailable
    queue.settle()                                            # a switch ended: every waiter looks again

The gate beside gateway/admission.py (which bounds the gateway as a whole): it holds nothing in flight, and a
client that leaves or times out frees its place at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable

from crossover.gateway.errors import SwitchUnavailable

# Why a held request was refused (the `reason` label of crossover_switch_dropped_total).
QUEUE_FULL = "queue_full"
QUEUE_TIMEOUT = "queue_timeout"


class SwitchQueue:
    def __init__(self, max_waiting: int, timeout: float, on_drop: Callable[[str], None] = lambda reason: None) -> None:
        self.max_waiting = max_waiting
        self.timeout = timeout
        self.on_drop = on_drop
        self._waiters: deque[asyncio.Future[None]] = deque()

    def __len__(self) -> int:
        return len(self._waiters)

    async def wait(self, ready: Callable[[], bool], under_way: Callable[[], str], retry_after_s: Callable[[], int]):
        """Return once `ready()` (checked after every settle); SwitchUnavailable past the bound or the deadline.

        `ready` may itself raise (no mode serves, shutting down): that ends the wait with its error.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        while not ready():
            if len(self._waiters) >= self.max_waiting:
                self.on_drop(QUEUE_FULL)
                raise SwitchUnavailable(
                    f"{under_way()} and {self.max_waiting} requests already wait for it",
                    code="switch_queue_full",
                    retry_after_s=retry_after_s(),
                )
            waiter = loop.create_future()
            self._waiters.append(waiter)
            try:
                async with asyncio.timeout_at(deadline):
                    await waiter
            except TimeoutError:
                self.on_drop(QUEUE_TIMEOUT)
                raise SwitchUnavailable(
                    f"waited {self.timeout:g} s while {under_way()}",
                    code="switch_queue_timeout",
                    retry_after_s=retry_after_s(),
                ) from None
            finally:
                # A client that leaves (cancellation) or times out frees its place at once.
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)

    def settle(self) -> None:
        """A switch ended (a mode serves, or none does): every waiting request looks again."""
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
