"""The engine in real time: one asyncio task runs the steps, sleeping each step's duration / time_scale.

    live = LiveEngine(engine, time_scale=50.0, memory=profile.memory)   # delays: the profile's, / time_scale
    await live.start()
    seq = live.submit(Sequence(input_tokens=20, max_new_tokens=64))   # may raise QueueFull
    async for new_tokens in live.stream(seq): ...                     # one item per step that fed seq
    live.abort(seq)                                                   # client gone: the slot frees now
    await live.stop()

The engine's clock is profile time: it advances by each step's duration (and by idle time x time_scale),
so the engine computes exactly what it computes in a virtual-time curve; only the sleeping differs.
Steps are scheduled against deadlines, so sleep overshoot is made up on the next step; when the machine
cannot keep up for longer than MAX_LAG_S, the loop stops catching up and simply runs slower.

Lifecycle states SGLang has and the stand-in mirrors: starting (weights loading), paused
(`/pause_generation`), released (`/release_memory_occupation`: no weights, no generation). Their durations
come from the profile's [memory] section in profile seconds, divided by the time scale like every other
duration; the `*_delay_s` arguments (`--startup-delay`, `--release-delay`, `--resume-delay`) override them
in wall-clock seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator

from crossover.servers.sim.engine import Engine, PauseMode, Sequence, Step
from crossover.servers.sim.profile import Memory

MAX_LAG_S = 0.25
THROUGHPUT_WINDOW_S = 5.0
THROUGHPUT_SAMPLE_S = 0.25
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


class Busy(Exception):
    """An operation that needs an idle engine (SGLang asserts it) found requests in flight."""


class LiveEngine:
    def __init__(
        self,
        engine: Engine,
        *,
        time_scale: float,
        memory: Memory,
        startup_delay_s: float | None = None,
        release_delay_s: float | None = None,
        resume_delay_s: float | None = None,
    ):
        if time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        self.engine = engine
        self.time_scale = time_scale

        def wall(override: float | None, profile_s: float) -> float:
            return profile_s / time_scale if override is None else override

        # Wall-clock seconds of each lifecycle operation.
        self.startup_delay_s = wall(startup_delay_s, memory.startup_s)
        self.release_delay_s = wall(release_delay_s, memory.release_s)
        self.resume_delay_s = wall(resume_delay_s, memory.resume_s)
        self._ready_at = 0.0
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._clock = 0.0
        # The clock between step boundaries: anchored at the start of the current step (or idle period).
        self._anchor_real = 0.0
        self._anchor_clock = 0.0
        self._anchor_limit = 0.0
        self._samples: deque[tuple[float, int]] = deque()
        self.released: set[str] = set()
        self.failure: str | None = None

    # --- lifecycle ------------------------------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._ready_at = loop.time() + self.startup_delay_s
        self._anchor(loop.time(), float("inf"))
        self._samples.append((time.monotonic(), 0))
        self._task = asyncio.create_task(self._run(), name="sim-step-loop")
        self._task.add_done_callback(self._crashed)

    def abort_all(self) -> None:
        """Shutting down: every request ends now (streams close with finish_reason "abort")."""
        for seq in self.engine.pause("abort"):
            _wake(seq)

    async def stop(self) -> None:
        self.abort_all()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    @property
    def starting(self) -> bool:
        return asyncio.get_running_loop().time() < self._ready_at

    @property
    def healthy(self) -> bool:
        """What SGLang's /health reports: a one-token generation would succeed now."""
        return not (self.starting or self.released or self.engine.paused or self.failure)

    def refusal(self) -> str | None:
        """Why a new generation must be refused with 503, or None."""
        if self.failure:
            return self.failure
        if self.starting:
            return "The server is starting (loading weights)."
        if self.released:
            return (
                "The server's GPU memory is released ("
                + ", ".join(sorted(self.released))
                + "); call /resume_memory_occupation first."
            )
        return None

    # --- requests -------------------------------------------------------------------------------------

    def now(self) -> float:
        """The engine's clock (profile seconds), read between step boundaries as real time x time_scale."""
        elapsed = (asyncio.get_running_loop().time() - self._anchor_real) * self.time_scale
        return self._anchor_clock + min(elapsed, self._anchor_limit)

    def submit(self, seq: Sequence) -> Sequence:
        self.engine.submit(seq, self.now())
        self._wake.set()
        return seq

    def abort(self, seq: Sequence) -> None:
        if self.engine.abort(seq):
            _wake(seq)
            self._wake.set()  # a queued request may now fit

    async def stream(self, seq: Sequence) -> AsyncIterator[int]:
        """New-token counts for `seq` as steps produce them; ends when it finishes or is aborted."""
        loop = asyncio.get_running_loop()
        sent = 0
        while True:
            new = seq.generated - sent
            if new:
                sent += new
                yield new
            elif seq.done:
                return
            else:
                seq.listener = waiter = loop.create_future()
                await waiter

    async def finished(self, seq: Sequence) -> None:
        async for _ in self.stream(seq):
            pass

    # --- control (SGLang's admin endpoints) -------------------------------------------------------------

    def pause(self, mode: PauseMode) -> None:
        for seq in self.engine.pause(mode):
            _wake(seq)

    def resume_generation(self) -> None:
        self.engine.resume()
        self._wake.set()

    async def release_memory(self, tags: list[str] | None) -> None:
        engine = self.engine
        if engine.num_running or (engine.num_waiting and not engine.paused):
            raise Busy(
                f"cannot release memory with requests in flight ({engine.num_running} running, "
                f"{engine.num_waiting} waiting); drain the server or /pause_generation first"
            )
        self.released |= set(tags or MEMORY_TAGS)
        await asyncio.sleep(self.release_delay_s)

    async def resume_memory(self, tags: list[str] | None) -> None:
        await asyncio.sleep(self.resume_delay_s)
        self.released -= set(tags or MEMORY_TAGS)
        self._wake.set()

    # --- load -----------------------------------------------------------------------------------------

    def gen_throughput(self) -> float:
        """Output tokens per (real) second over the last THROUGHPUT_WINDOW_S, like SGLang's gauge."""
        now = time.monotonic()
        self._sample(now)
        t0, n0 = self._samples[0]
        return (self.engine.generated_total - n0) / (now - t0) if now > t0 else 0.0

    def _sample(self, now: float) -> None:
        samples = self._samples
        if now - samples[-1][0] >= THROUGHPUT_SAMPLE_S:
            samples.append((now, self.engine.generated_total))
        while len(samples) > 1 and now - samples[1][0] >= THROUGHPUT_WINDOW_S:
            samples.popleft()

    # --- the step loop --------------------------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        engine, scale = self.engine, self.time_scale
        deadline = loop.time()
        while True:
            step = engine.next_step(self._clock)
            if step is None or step.kind == "wait":
                # Nothing is computing: sleep until there is work, or until a first token is due (measured
                # profiles), but wake early for an arrival - its first token may be due sooner.
                self._wake.clear()
                self._anchor(loop.time(), step.duration if step else float("inf"))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), step.duration / scale if step else None)
                deadline = loop.time()
                self._clock = self.now()
                if step is not None:
                    self._deliver(step)
                continue
            self._anchor(loop.time(), step.duration)
            deadline = max(deadline, loop.time() - MAX_LAG_S) + step.duration / scale
            delay = deadline - loop.time()
            # Even when late, yield once so the streams can write what the last step produced.
            await asyncio.sleep(delay if delay > 0 else 0)
            self._clock += step.duration
            self._deliver(step)

    def _deliver(self, step: Step) -> None:
        touched, _ = self.engine.finish_step(step, self._clock)
        for seq in touched:
            _wake(seq)
        self._sample(time.monotonic())

    def _crashed(self, task: asyncio.Task) -> None:
        # A bug in the step loop must not leave clients hanging: end every request and refuse new ones.
        if not task.cancelled() and task.exception() is not None:
            self.failure = f"The simulated engine failed: {task.exception()!r}"
            self.abort_all()

    def _anchor(self, real: float, limit: float) -> None:
        self._anchor_real, self._anchor_clock, self._anchor_limit = real, self._clock, limit


def _wake(seq: Sequence) -> None:
    waiter = seq.listener
    if waiter is not None:
        seq.listener = None
        if not waiter.done():
            waiter.set_result(None)
