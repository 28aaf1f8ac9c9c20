"""Virtual-time curves: what a profile predicts, computed with the live engine's code and no sleeping.

    sweep(profile, [1, 2, 5], input_len=256, output_len=512)   # closed-loop load, one point per concurrency
    batch_table(profile, [1, 64, 256], context=1024)           # one decode step at a fixed batch size

A level at concurrency C runs C clients in a closed loop (each sends its next request the moment the last
one ends, as `bench_serving --max-concurrency C` does). The first WARMUP_ROUNDS x C completions are not
measured; the window then runs until MEASURED_ROUNDS x C (at least MIN_MEASURED_REQUESTS) more have
completed, with clients still sending,
so it sees steady state rather than ramp-up or drain. Definitions (bench_serving's where they exist):

- output_throughput: output tokens generated in the window / its length (tok/s);
- per_request_throughput: 1 / mean TPOT, TPOT = (e2e - ttft) / (output_tokens - 1): the decode speed one
  request sees after its first token (the inverse of the mean, so a load test's `mean_tpot_ms` replays
  exactly as a measured profile);
- mean_ttft_s: mean time from sending to the first token, queueing included;
- running / queued: time-averaged running batch and waiting queue (queueing shows as queued > 0 while
  output_throughput stays flat).
All values are in the profile's time: a live stand-in at --time-scale F is F times faster.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

from crossover.servers.sim.engine import Engine, Sequence
from crossover.servers.sim.profile import Profile

WARMUP_ROUNDS = 1
MEASURED_ROUNDS = 3
# At low concurrency a few requests hold few accepted-token draws: measure at least this many.
MIN_MEASURED_REQUESTS = 64


@dataclass(frozen=True)
class CurvePoint:
    concurrency: int
    output_throughput: float
    per_request_throughput: float
    mean_ttft_s: float
    running: float
    queued: float
    # Each measured request's time to first token (the replay repeats them for the stretches it skips).
    ttfts: tuple[float, ...] = dataclasses.field(default=(), repr=False, compare=False)


@dataclass(frozen=True)
class BatchPoint:
    batch: int
    step_ms: float
    tokens_per_step: float
    output_throughput: float
    per_request_throughput: float


def sweep(
    profile: Profile, concurrencies: list[int], *, input_len: int, output_len: int, seed: int = 0
) -> list[CurvePoint]:
    return [run_level(profile, c, input_len=input_len, output_len=output_len, seed=seed) for c in concurrencies]


def run_level(
    profile: Profile,
    concurrency: int,
    *,
    input_len: int,
    output_len: int,
    seed: int = 0,
    measured_rounds: int = MEASURED_ROUNDS,
    zero_steps_above_bs: int | None = None,
    engine_type: type[Engine] = Engine,
) -> CurvePoint:
    """One level. `zero_steps_above_bs`: the patched engine's gate (engine.py), for the in-engine topology;
    `engine_type`: lazy_engine.LazyEngine steps many requests faster (the replay's levels)."""
    if concurrency < 1 or input_len < 1 or output_len < 2:
        raise ValueError("concurrency and input_len must be >= 1 and output_len >= 2 (TPOT needs two tokens)")
    # Clients in a closed loop wait rather than give up, so a queue bound would only make them spin.
    profile = dataclasses.replace(profile, limits=dataclasses.replace(profile.limits, max_queued_requests=None))
    engine = engine_type(profile, random.Random(seed))
    engine.zero_steps_above_bs = zero_steps_above_bs
    if not engine.fits(input_len, output_len):
        raise ValueError(
            f"input_len + output_len = {input_len + output_len} exceeds the profile's KV pool "
            f"({profile.limits.max_total_num_tokens} tokens)"
        )
    warmup = WARMUP_ROUNDS * concurrency
    total = warmup + max(measured_rounds * concurrency, MIN_MEASURED_REQUESTS)
    now = 0.0
    for _ in range(concurrency):
        engine.submit(Sequence(input_len, output_len), now)
    completed = measured = 0
    start = tokens_at_start = None
    tpot_sum = running_area = queued_area = 0.0
    ttfts: list[float] = []
    while completed < total:
        step = engine.next_step(now)
        if step is None:
            raise RuntimeError(f"{profile.name}: the engine stalled at concurrency {concurrency}")
        if start is not None:
            running_area += engine.num_running * step.duration
            queued_area += engine.num_waiting * step.duration
        now += step.duration
        for seq in engine.finish_step(step, now)[1]:
            completed += 1
            if start is not None:
                measured += 1
                ttfts.append(seq.first_token_at - seq.arrival)
                tpot_sum += (seq.finished_at - seq.first_token_at) / (seq.generated - 1)
            elif completed == warmup:
                start, tokens_at_start = now, engine.generated_total
            engine.submit(Sequence(input_len, output_len), now)
    window = now - start
    return CurvePoint(
        concurrency=concurrency,
        output_throughput=(engine.generated_total - tokens_at_start) / window,
        per_request_throughput=measured / tpot_sum if tpot_sum > 0 else float("inf"),
        mean_ttft_s=sum(ttfts) / measured,
        running=running_area / window,
        queued=queued_area / window,
        ttfts=tuple(ttfts),
    )


def batch_table(profile: Profile, batches: list[int], *, context: int) -> list[BatchPoint]:
    """Decode-only throughput at fixed batch sizes and context (no prefill, no caps): the step model itself."""
    engine = Engine(profile, random.Random(0))
    tokens = profile.speculative.accept_length if profile.speculative else 1.0
    points = []
    for batch in batches:
        step_s = engine.costs.decode_s(batch, batch * context, batch)
        points.append(BatchPoint(batch, step_s * 1000.0, tokens, batch * tokens / step_s, tokens / step_s))
    return points
