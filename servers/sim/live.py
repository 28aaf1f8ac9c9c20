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
cannot keep up for longer than MAX_LAG_S, the loop stops catching up and simply runs slower - and says so
(schedule.py: `schedule_report()`, a warning line when it starts lagging).

Lifecycle states SGLang has and the stand-in mirrors (0.5.23: tokenizer_manager.py, scheduler.py,
scheduler_components/weight_updater.py): starting (weights loading); paused (`/pause_generation`: new requests
are held outside the engine until `/continue_generation`, as SGLang's tokenizer manager holds them); released
(`/release_memory_occupation`: refused while busy, where SGLang's scheduler asserts; no generation). Their durations
come from the profile's [memory] section in profile seconds, divided by the time scale like every other
duration; the `*_delay_s` arguments (`--startup-delay`, `--release-delay`, `--resume-delay`) override them
in wall-clock seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

from crossover.servers.sim.engine import QUEUE_FULL_MESSAGE, Engine, PauseMode, QueueFull, Sequence, State, Step
from crossover.servers.sim.profile import Memory
from crossover.servers.sim.schedule import ScheduleTracker

logger = logging.getLogger(__name__)

MAX_LAG_S = 0.25
THROUGHPUT_WINDOW_S = 5.0
THROUGHPUT_SAMPLE_S = 0.25
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


class Busy(Exception):
    """An operation that needs an idle engine (SGLang asserts it) found requests in flight."""


@dataclass
class MemoryStats:
    """Every /release_memory_occupation and /resume_memory_occupation call, as `/server_info` reports them."""

    release_total: int = 0  # releases done
    release_refused_total: int = 0  # refused: requests in flight (SGLang 0.5.23 would crash on its assertion)
    resume_total: int = 0  # resumes done
    resume_not_released_total: int = 0  # resumes of memory that was not released (SGLang: KeyError, crash)


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
        self.schedule: ScheduleTracker | None = None  # made in start(), on the loop's clock
        # Requests in the engine integrated over wall time (request-seconds), up to `_held_at` (the loop's clock):
        # a reader compares it with the requests it kept open. A stand-in whose HTTP side lags keeps its clock
        # (the engine idles, which counts as on time) while requests wait outside it, so only this shows the lag.
        self._held_request_s = 0.0
        self._held_at = 0.0
        self.released: set[str] = set()
        self.memory_stats = MemoryStats()
        # Requests that arrived while generation was paused: SGLang's tokenizer manager holds them before the
        # scheduler (no queue limit, not in the scheduler's counts) until /continue_generation.
        self._held: list[Sequence] = []
        self.failure: str | None = None

    # --- lifecycle ------------------------------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._ready_at = loop.time() + self.startup_delay_s
        self._anchor(loop.time(), float("inf"))
        self._samples.append((time.monotonic(), 0))
        self._held_at = loop.time()
        self.schedule = ScheduleTracker(self.time_scale, now=loop.time(), clock=self._clock)
        self._task = asyncio.create_task(self._run(), name="sim-step-loop")
        self._task.add_done_callback(self._crashed)

    def abort_all(self) -> None:
        """Shutting down: every request ends now (streams close with finish_reason "abort")."""
        self._count_held()
        for seq in self.engine.pause("abort"):
            _wake(seq)
        held, self._held = self._held, []
        for seq in held:
            self._end(seq, None)

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

    def refusal(self, *, released: bool = True) -> str | None:
        """Why a new generation must be refused with 503, or None (`released` False: not for released memory -
        vLLM holds requests while it sleeps)."""
        if self.failure:
            return self.failure
        if self.starting:
            return "The server is starting (loading weights)."
        if self.released and released:
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

    @property
    def num_held(self) -> int:
        return len(self._held)

    def submit(self, seq: Sequence) -> Sequence:
        """Queue `seq` in the engine (QueueFull if its waiting queue is full), or hold it while paused."""
        self._count_held()
        if self.engine.paused:
            seq.arrival = self.now()
            self._held.append(seq)
            return seq
        self.engine.submit(seq, self.now())
        self._wake.set()
        return seq

    def abort(self, seq: Sequence) -> None:
        self._count_held()
        if seq.state is State.NEW and seq in self._held:
            self._held.remove(seq)
            self._end(seq, None)
        elif self.engine.abort(seq):
            _wake(seq)
            self._wake.set()  # a queued request may now fit

    def _end(self, seq: Sequence, error: str | None) -> None:
        """End a request that is not (or no longer) in the engine: aborted, with `error` for its client."""
        seq.state, seq.error = State.ABORTED, error
        self.engine.aborted_total += 1
        _wake(seq)

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
        """/continue_generation: the engine steps again and the held requests enter it.

        With memory still released SGLang would run them on freed GPU memory; here they end at once with an
        error that says so (the requests in the engine too), rather than hang or pretend."""
        engine, now = self.engine, self.now()
        engine.resume()
        held, self._held = self._held, []
        if self.released:
            reason = self.refusal() or "memory released"
            for seq in engine.pause("abort"):
                seq.error = reason
                _wake(seq)
            engine.resume()
            for seq in held:
                self._end(seq, reason)
            return
        for seq in held:
            try:
                engine.submit(seq, now)
            except QueueFull:
                self._end(seq, QUEUE_FULL_MESSAGE)
        self._wake.set()

    async def release_memory(self, tags: list[str] | None) -> None:
        """SGLang asserts the scheduler is idle (waiting requests allowed while paused); 0.5.23 raises that
        assertion in the scheduler process, which takes the server down. The stand-in refuses (Busy) and counts."""
        engine = self.engine
        if engine.num_running or (engine.num_waiting and not engine.paused):
            self.memory_stats.release_refused_total += 1
            raise Busy(
                f"cannot release memory with requests in flight ({engine.num_running} running, "
                f"{engine.num_waiting} waiting); drain the server or /pause_generation first "
                "(SGLang asserts: release_memory_occupation should be called only when server is idle)"
            )
        self.released |= set(tags or MEMORY_TAGS)
        self.memory_stats.release_total += 1
        await asyncio.sleep(self.release_delay_s)

    async def resume_memory(self, tags: list[str] | None) -> None:
        wanted = set(tags or MEMORY_TAGS)
        if not wanted <= self.released:
            # SGLang 0.5.23 removes each tag from its set of released ones (KeyError if absent: the scheduler
            # dies). The stand-in carries on, but says so: a switch that does this would crash a real server.
            self.memory_stats.resume_not_released_total += 1
            logger.warning(
                "resume_memory_occupation of %s, which is not released (released: %s): SGLang 0.5.23 would crash",
                sorted(wanted - self.released),
                sorted(self.released) or "none",
            )
        await asyncio.sleep(self.resume_delay_s)
        self.released -= wanted
        self.memory_stats.resume_total += 1
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

    def schedule_report(self) -> dict:
        """`/server_info` "schedule": whether this stand-in keeps up with its profile at its time scale."""
        assert self.schedule is not None, "start() first"
        clock = self.now()
        self._count_held()
        # The engine's own clock and output count let a reader judge throughput in profile time, which no
        # load on the machine can skew (tests/servers/sim/test_live.py does); the requests it held over wall
        # time, against those the reader kept open, whether the load reached it.
        return {
            **self.schedule.report(self._held_at, clock),
            "clock_s": round(clock, 6),
            "generated_tokens": self.engine.generated_total,
            "wall_s": round(self._held_at, 6),
            "held_request_s": round(self._held_request_s, 6),
        }

    def _count_held(self) -> None:
        """Add the requests in the engine since the last count; called before anything changes their number."""
        now = asyncio.get_running_loop().time()
        engine = self.engine
        self._held_request_s += (engine.num_running + engine.num_waiting + len(self._held)) * (now - self._held_at)
        self._held_at = now

    def schedule_ratio(self) -> float:
        """`speed_ratio` of the schedule report (1.0 before start())."""
        return self.schedule_report()["speed_ratio"] if self.schedule is not None else 1.0

    def schedule_lag_s(self) -> float:
        return self.schedule.lag_s(asyncio.get_running_loop().time()) if self.schedule is not None else 0.0

    # --- the step loop --------------------------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        engine, scale, schedule = self.engine, self.time_scale, self.schedule
        assert schedule is not None
        deadline = loop.time()
        while True:
            step = engine.next_step(self._clock)
            if step is None or step.kind == "wait":
                # Nothing is computing: sleep until there is work, or until a first token is due (measured
                # profiles), but wake early for an arrival - its first token may be due sooner.
                schedule.idle()
                self._wake.clear()
                self._anchor(loop.time(), step.duration if step else float("inf"))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), step.duration / scale if step else None)
                deadline = loop.time()
                self._clock = self.now()
                if step is not None:
                    self._deliver(step)
                continue
            now = loop.time()
            self._anchor(now, step.duration)
            schedule.step_started(now, step.duration / scale)
            deadline = max(deadline, now - MAX_LAG_S) + step.duration / scale
            delay = deadline - loop.time()
            # Even when late, yield once so the streams can write what the last step produced.
            await asyncio.sleep(delay if delay > 0 else 0)
            self._clock += step.duration
            self._deliver(step)
            schedule.step_done(loop.time(), self._clock)

    def _deliver(self, step: Step) -> None:
        self._count_held()
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
