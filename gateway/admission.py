"""The gateway's own limit: at most `max_inflight` requests at once, up to `max_queued` more waiting (FIFO)."""

from __future__ import annotations

import asyncio
from collections import deque

from crossover.gateway.errors import Overloaded

RETRY_AFTER_S = 1


class Admission:
    def __init__(self, max_inflight: int, max_queued: int, queue_timeout: float) -> None:
        self.max_inflight = max_inflight
        self.max_queued = max_queued
        self.queue_timeout = queue_timeout
        self.active = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def queued(self) -> int:
        return len(self._waiters)

    def take_free(self) -> bool:
        """Take a slot if one is free and nobody waits for it; False, with nothing taken, otherwise."""
        if self.active < self.max_inflight and not self._waiters:
            self.active += 1
            return True
        return False

    async def acquire(self) -> None:
        """Take a slot, waiting in line if needed; raise Overloaded when the line is full or too slow."""
        if self.take_free():
            return
        if len(self._waiters) >= self.max_queued:
            raise Overloaded(
                f"the gateway is at its limit of {self.max_inflight} requests in flight", retry_after_s=RETRY_AFTER_S
            )
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(self.queue_timeout):
                await waiter
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled():
                self.release()  # the slot was handed over just as we gave up: pass it on
            else:
                waiter.cancel()
                if waiter in self._waiters:  # release() may already have dropped it
                    self._waiters.remove(waiter)
            if isinstance(exc, TimeoutError):
                raise Overloaded(
                    f"waited {self.queue_timeout:g} s for one of {self.max_inflight} request slots",
                    retry_after_s=RETRY_AFTER_S,
                ) from None
            raise

    def release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot moves to the waiter; `active` is unchanged
                return
        self.active -= 1
