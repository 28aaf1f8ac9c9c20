"""Continuous batching as SGLang's scheduler does it, with the clock left to the caller.

    engine = Engine(profile, random.Random(seed))
    engine.submit(Sequence(input_tokens=256, max_new_tokens=512), now)
    step = engine.next_step(now)                      # the next forward pass and how long it takes
    touched, finished = engine.finish_step(step, now + step.duration)

`curve.py` advances a virtual clock by each step's duration; `live.py` sleeps it. Like SGLang (without
mixed chunked prefill), a step either prefills newly admitted requests - every running request waits - or
decodes one step for every running request. Admission is FIFO, bounded by `max_running_requests`, the
prefill token budget and the KV pool (a request reserves input + max_new_tokens; SGLang reserves less and
retracts under pressure, the stand-in never has to). `max_queued_requests` bounds the waiting queue.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

from crossover.servers.sim.costs import Acceptance, Costs, make_costs
from crossover.servers.sim.profile import Profile
from crossover.servers.sim.profile_file import check_accept_length

# SGLang's --decode-log-interval default: its scheduler logs (and sets the spec_accept_length gauge) every this many
# decode batches, from the acceptance of those batches alone.
DECODE_LOG_INTERVAL = 40

QUEUE_FULL_MESSAGE = "The request queue is full."  # SGLang's words (managers/scheduler.py)
PauseMode = Literal["abort", "retract", "in_place"]
PAUSE_MODES: tuple[PauseMode, ...] = ("abort", "retract", "in_place")


class State(enum.Enum):
    NEW = "new"
    WAITING = "waiting"
    PREFILL = "prefill"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


class QueueFull(Exception):
    """The waiting queue is at `max_queued_requests`; SGLang rejects the new request with 503."""


@dataclass(eq=False, slots=True)
class Sequence:
    """One request inside the engine. Times are engine (profile) seconds."""

    input_tokens: int
    max_new_tokens: int
    arrival: float = 0.0
    generated: int = 0
    state: State = State.NEW
    admitted_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    ready_at: float = 0.0
    # Why the server ended it early, for the client (e.g. the queue was full when a paused server went on).
    error: str | None = None
    # Set by live.py: woken whenever this sequence gains tokens or ends.
    listener: Any = field(default=None, repr=False)

    @property
    def context(self) -> int:
        return self.input_tokens + self.generated

    @property
    def reservation(self) -> int:
        return self.input_tokens + self.max_new_tokens

    @property
    def done(self) -> bool:
        return self.state is State.FINISHED or self.state is State.ABORTED


@dataclass(slots=True)
class Step:
    kind: Literal["prefill", "decode", "wait"]
    seqs: list[Sequence]
    duration: float
    # A decode the speculation gate sent to zero draft steps: one token per request, no acceptance draw.
    zero_step: bool = False


class Engine:
    def __init__(self, profile: Profile, rng: random.Random, costs: Costs | None = None):
        self.limits = profile.limits
        self.costs = costs or make_costs(profile)
        spec = profile.speculative
        self.acceptance = Acceptance(spec.num_steps, spec.accept_length) if spec else None
        self._rng = rng
        self._waiting: deque[Sequence] = deque()
        self._prefilling: dict[Sequence, None] = {}
        self._running: dict[Sequence, None] = {}
        self._due: list[tuple[float, int, Sequence]] = []  # overlapped prefill: first tokens by time
        self._tie = itertools.count()
        self._reserved = 0
        self._used = 0
        self.paused = False
        self.generated_total = 0
        self.finished_total = 0
        self.aborted_total = 0
        self.spec_accepted_total = 0
        self.spec_verify_total = 0
        # The last full window's tokens per verify (DECODE_LOG_INTERVAL speculative decode batches); 0: none yet.
        self.recent_accept_length = 0.0
        self._window_accepted = self._window_verified = self._window_batches = 0
        # The patched engine's run-time gate (patches/sglang-0.5.23): decode batches of more than this many
        # running requests take zero draft steps. None: no gate. Only meaningful on a speculative profile.
        self.zero_steps_above_bs: int | None = None
        # Its hysteresis (the patch's gate_min_dwell_steps): a flip waits until the state has held this many
        # decode batches; a new threshold decides at once. 0: every batch decides (what the replay assumes).
        self.gate_min_dwell_steps = 0
        self.gate_engaged = False
        self.gate_flips_total = 0
        self._gate_held = 0
        self._gate_for: int | None = None
        self.skip_zero_step_draft_extend = False
        self.zero_step_batches_total = 0
        self.decode_batches_total = 0

    # --- state ----------------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._running) + len(self._prefilling)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_used_tokens(self) -> int:
        return self._used

    @property
    def idle(self) -> bool:
        return not (self._running or self._prefilling or self._waiting)

    def set_accept_length(self, accept_length: float) -> None:
        """Acceptance from now on (the traffic changed): the mean tokens per verify step of later draws, bonus
        included, in [1, num_steps + 1] (ProfileError else; ValueError on a profile without speculation). The window
        SGLang's gauge averages starts again."""
        if self.acceptance is None:
            raise ValueError("this profile does not speculate: it has no acceptance to change")
        check_accept_length(accept_length, self.acceptance.num_steps, "accept_length")
        self.acceptance = Acceptance(self.acceptance.num_steps, accept_length)
        self.recent_accept_length = 0.0
        self._window_accepted = self._window_verified = self._window_batches = 0

    @property
    def window_accept_length(self) -> float:
        """SGLang's `spec_accept_length` gauge: tokens per verify over its last window of DECODE_LOG_INTERVAL decode
        batches, held until the next one ends. Before the first full window (at start, or after `set_accept_length`)
        the window under way's, where SGLang shows 0 or the old value: a test need not decode 40 batches first."""
        if self.recent_accept_length:
            return self.recent_accept_length
        return self._window_accepted / self._window_verified if self._window_verified else 0.0

    @property
    def avg_accept_length(self) -> float:
        return self.spec_accepted_total / self.spec_verify_total if self.spec_verify_total else 0.0

    def fits(self, input_tokens: int, max_new_tokens: int) -> bool:
        """Whether the KV pool could ever hold this request (else it would wait forever)."""
        return input_tokens + max_new_tokens <= self.limits.max_total_num_tokens

    # --- requests -------------------------------------------------------------------------------------

    def submit(self, seq: Sequence, now: float) -> None:
        max_queued = self.limits.max_queued_requests
        if max_queued is not None and len(self._waiting) + 1 > max_queued:
            raise QueueFull(QUEUE_FULL_MESSAGE)
        if not self.fits(seq.input_tokens, seq.max_new_tokens):
            raise ValueError(
                f"request needs {seq.reservation} KV tokens, the pool holds {self.limits.max_total_num_tokens}"
            )
        seq.arrival, seq.state = now, State.WAITING
        self._waiting.append(seq)

    def abort(self, seq: Sequence) -> bool:
        """Drop a request wherever it is; True if it was still live. Its slot is free at once."""
        if seq.state is State.WAITING:
            self._waiting.remove(seq)
        elif seq.state is State.PREFILL:
            del self._prefilling[seq]
            self._release(seq)
        elif seq.state is State.RUNNING:
            del self._running[seq]
            self._release(seq)
        else:
            return False
        seq.state = State.ABORTED
        self.aborted_total += 1
        return True

    def pause(self, mode: PauseMode) -> list[Sequence]:
        """Stop scheduling (SGLang's /pause_generation); returns the sequences aborted by mode "abort"."""
        self.paused = True
        if mode == "abort":
            live = [*self._prefilling, *self._running, *self._waiting]
            for seq in live:
                self.abort(seq)
            return live
        if mode == "retract":
            # Running requests give their KV back and queue again in front, keeping what they generated.
            retracted = [*self._prefilling, *self._running]
            for seq in retracted:
                self._release(seq)
                seq.state = State.WAITING
            self._prefilling.clear()
            self._running.clear()
            self._waiting.extendleft(reversed(retracted))
        return []

    def resume(self) -> None:
        self.paused = False

    def shift_clock(self, delta: float) -> None:
        """Move every time the engine holds `delta` later (the replay skipped a stretch it had measured)."""
        for seq in (*self._waiting, *self._prefilling, *self._running):
            seq.arrival += delta
            seq.ready_at += delta
            if seq.admitted_at is not None:
                seq.admitted_at += delta
            if seq.first_token_at is not None:
                seq.first_token_at += delta
        self._due = [(t + delta, tie, seq) for t, tie, seq in self._due]  # the same order: a valid heap still

    # --- steps ----------------------------------------------------------------------------------------

    def next_step(self, now: float) -> Step | None:
        """The next forward pass, or None when there is nothing to do (or generation is paused)."""
        if self.paused:
            return None
        admitted = self._admit(now)
        in_flight = self.num_running + len(self._waiting)
        if not self.costs.overlapped_prefill:
            if admitted:
                tokens = sum(seq.context for seq in admitted)
                return Step("prefill", admitted, self.costs.prefill_s(tokens, len(admitted)))
            if self._running:
                return self._decode_step(in_flight)
            return None
        if self._running:
            return self._decode_step(in_flight)
        if self._due:
            return Step("wait", [], max(0.0, self._due[0][0] - now))
        return None

    def gated(self, batch: int) -> bool:
        """Whether a decode batch of `batch` requests takes zero steps now."""
        gate = self.zero_steps_above_bs
        if self.acceptance is None or gate is None:
            return False
        return self.gate_engaged if self.gate_min_dwell_steps else batch > gate

    def set_gate(self, threshold: int | None, min_dwell_steps: int) -> None:
        """A new gate setting: the next decode batch decides at once, whatever the dwell."""
        self.zero_steps_above_bs, self.gate_min_dwell_steps = threshold, min_dwell_steps
        self._gate_held = min_dwell_steps

    def _gate_decide(self, batch: int) -> bool:
        gate = self.zero_steps_above_bs
        want = self.acceptance is not None and gate is not None and batch > gate
        free = gate is None or gate != self._gate_for or self._gate_held >= self.gate_min_dwell_steps
        self._gate_for = gate
        if want != self.gate_engaged and free:
            self.gate_engaged, self._gate_held = want, 0
            self.gate_flips_total += 1
        self._gate_held += 1
        return self.gate_engaged

    def _decode_step(self, in_flight: int) -> Step:
        batch = len(self._running)
        if self._gate_decide(batch):
            duration = self.costs.zero_step_s(batch, self._used, self.skip_zero_step_draft_extend)
            return Step("decode", list(self._running), duration, zero_step=True)
        return Step("decode", list(self._running), self.costs.decode_s(batch, self._used, in_flight))

    def finish_step(self, step: Step, now: float) -> tuple[list[Sequence], list[Sequence]]:
        """Apply a step's results at `now`: (sequences that gained tokens or ended, those that finished)."""
        touched: list[Sequence] = []
        finished: list[Sequence] = []
        if step.kind == "prefill":
            for seq in step.seqs:
                if seq.state is State.PREFILL:
                    self._start(seq, now, touched, finished)
        elif step.kind == "decode":
            self._decode(step.seqs, now, touched, finished, zero_step=step.zero_step)
        while self._due and self._due[0][0] <= now:
            _, _, seq = heapq.heappop(self._due)
            if seq.state is State.PREFILL:
                self._start(seq, now, touched, finished)
        return touched, finished

    def _admit(self, now: float) -> list[Sequence]:
        limits, waiting = self.limits, self._waiting
        if not waiting:
            return []  # most steps (this is asked before each)
        room = limits.max_running_requests - self.num_running
        in_flight = self.num_running + len(waiting)
        batch: list[Sequence] = []
        tokens = 0
        while waiting and len(batch) < room:
            seq = waiting[0]
            if self._reserved + seq.reservation > limits.max_total_num_tokens:
                break
            # The prefill budget bounds a batch, but one long prompt still goes (SGLang chunks it).
            if batch and tokens + seq.context > limits.max_prefill_tokens:
                break
            waiting.popleft()
            seq.state, seq.admitted_at = State.PREFILL, now
            self._prefilling[seq] = None
            self._reserved += seq.reservation
            self._used += seq.context
            tokens += seq.context
            if self.costs.overlapped_prefill:
                seq.ready_at = now + self.costs.first_token_s(in_flight)
                heapq.heappush(self._due, (seq.ready_at, next(self._tie), seq))
            batch.append(seq)
        return batch

    def _start(self, seq: Sequence, now: float, touched: list[Sequence], finished: list[Sequence]) -> None:
        """Prefill done: the request joins the decode batch with its first token (if it wants any)."""
        del self._prefilling[seq]
        seq.state = State.RUNNING
        self._running[seq] = None
        if seq.first_token_at is None:
            seq.first_token_at = now
        if seq.generated < seq.max_new_tokens:
            seq.generated += 1
            self._used += 1
            self.generated_total += 1
        touched.append(seq)
        if seq.generated >= seq.max_new_tokens:
            self._finish(seq, now)
            finished.append(seq)

    def _decode(
        self, seqs: list[Sequence], now: float, touched: list[Sequence], finished: list[Sequence], zero_step=False
    ) -> None:
        acceptance = None if zero_step else self.acceptance
        rng, running = self._rng, State.RUNNING
        self.decode_batches_total += 1
        if zero_step:
            self.zero_step_batches_total += 1
        if acceptance is None:
            self._decode_one_each(seqs, now, touched, finished)
            return
        produced = verified = accepted = 0
        live = [seq for seq in seqs if seq.state is running]
        for seq, n in zip(live, acceptance.draw_many(rng, len(live)), strict=True):
            accepted += n
            verified += 1
            remaining = seq.max_new_tokens - seq.generated
            n = min(n, remaining)
            seq.generated += n
            self._used += n
            produced += n
            touched.append(seq)
            if n == remaining:
                self._finish(seq, now)
                finished.append(seq)
        self.generated_total += produced
        self.spec_accepted_total += accepted
        self.spec_verify_total += verified
        self._window_accepted += accepted
        self._window_verified += verified
        self._window_batches += 1
        if self._window_batches >= DECODE_LOG_INTERVAL:
            if self._window_verified:
                self.recent_accept_length = self._window_accepted / self._window_verified
            self._window_accepted = self._window_verified = self._window_batches = 0

    def _decode_one_each(
        self, seqs: list[Sequence], now: float, touched: list[Sequence], finished: list[Sequence]
    ) -> None:
        """A plain decode step: one token for every running sequence (the hot loop of a virtual replay)."""
        running, produced = State.RUNNING, 0
        for seq in seqs:
            if seq.state is not running:
                continue
            seq.generated += 1
            produced += 1
            touched.append(seq)
            if seq.generated >= seq.max_new_tokens:
                self._finish(seq, now)
                finished.append(seq)
        self._used += produced
        self.generated_total += produced

    def _finish(self, seq: Sequence, now: float) -> None:
        del self._running[seq]
        self._release(seq)
        seq.state, seq.finished_at = State.FINISHED, now
        self.finished_total += 1

    def _release(self, seq: Sequence) -> None:
        self._reserved -= seq.reservation
        self._used -= seq.context
