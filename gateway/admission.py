"""The gateway's own limit: at most `max_inflight` requests at once, up to `max_queued` more waiting.

    await admission.acquire(tier)      # a slot, waiting in line if need be; Overloaded (429) past the bounds
    admission.release()                # the slot to the first in line, else free

The line is FIFO within a service tier, and tiers are served in order: `priority`, then the rest (a request with no
tier, `auto`, `default`), then `flex`, which waits first. When the line is full, a newcomer that is not `flex` takes
the place of the newest `flex` waiter, which is refused (shed first); a `flex` newcomer is refused.
"""

from __future__ import annotations

import asyncio
from collections import deque

from crossover.gateway.errors import Overloaded
from crossover.gateway.policies import FLEX, PRIORITY

RETRY_AFTER_S = 1


class Admission:
    def __init__(self, max_inflight: int, max_queued: int, queue_timeout: float) -> None:
        self.max_inflight = max_inflight
        self.max_queued = max_queued
        self.queue_timeout = queue_timeout
        self.active = 0
        # The line, by tier: served first to last.
        self._priority: deque[asyncio.Future[None]] = deque()
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._flex: deque[asyncio.Future[None]] = deque()
        self._lines = (self._priority, self._waiters, self._flex)

    @property
    def queued(self) -> int:
        return len(self._priority) + len(self._waiters) + len(self._flex)

    def take_free(self) -> bool:
        """Take a slot if one is free and nobody waits for it; False, with nothing taken, otherwise."""
        if self.active < self.max_inflight and not (self._waiters or self._priority or self._flex):
            self.active += 1
            return True
        return False

    async def acquire(self, tier: str | None = None) -> None:
        """Take a slot, waiting in line if needed; raise Overloaded when the line is full or too slow."""
        if self.take_free():
            return
        line = self._priority if tier == PRIORITY else self._flex if tier == FLEX else self._waiters
        if self.queued >= self.max_queued:
            if line is self._flex or not self._flex:
                raise Overloaded(
                    f"the gateway is at its limit of {self.max_inflight} requests in flight",
                    retry_after_s=RETRY_AFTER_S,
                )
            self._shed(self._flex.pop())
        waiter = asyncio.get_running_loop().create_future()
        line.append(waiter)
        try:
            async with asyncio.timeout(self.queue_timeout):
                await waiter
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled():
                if waiter.exception() is None:
                    self.release()  # the slot was handed over just as we gave up: pass it on
                # else: shed (`_shed`), out of line and holding nothing
            else:
                waiter.cancel()
                if waiter in line:  # release() may already have dropped it
                    line.remove(waiter)
            if isinstance(exc, TimeoutError):
                raise Overloaded(
                    f"waited {self.queue_timeout:g} s for one of {self.max_inflight} request slots",
                    retry_after_s=RETRY_AFTER_S,
                ) from None
            raise

    def _shed(self, waiter: asyncio.Future[None]) -> None:
        if not waiter.done():
            waiter.set_exception(
                Overloaded(
                    f"the gateway is at its limit of {self.max_inflight} requests in flight and its line is full: "
                    "a 'flex' request gave its place to a request of a higher service tier",
                    retry_after_s=RETRY_AFTER_S,
                )
            )

    def release(self) -> None:
        for line in self._lines:
            while line:
                waiter = line.popleft()
                if not waiter.done():
                    waiter.set_result(None)  # the slot moves to the waiter; `active` is unchanged
                    return
        self.active -= 1
