"""`crossover bench` over the real vLLM pair, the gateway routed with what it found, and a stand-in fitted to it.

Sized to the host: the fixture measured each server's time per token at one stream (`RealVLLM.token_s`), and the
output length, the measurement windows and the bench's time limit are derived from it (`Sweep.for_host`).
A host where the speculative server is not the faster one at one stream cannot show a crossover at all - an
AVX2-only CPU ran the target at 7.1 tok/s speculative and 14.8 plain, and a sweep sized for a fast CPU then ran
past its timeout - so there the sweep's tests skip, in one line with the measured figures. Elsewhere (CI's machine):

1. A sweep of the speculative (EAGLE-3, synthetic acceptance) and the plain server over GRID, fine enough at the
   low end to place the crossing (measured on CI's kind of host with the target of tiny_model.py: speculative
   1.34x ahead at C=1, plain 1.47-1.56x ahead at C=64, crossing at C=1.6). Strict: speculative must be clearly
   ahead at C=1 and plain clearly ahead at the top (a tie fails: the project exists for this crossing), and the
   crossing is placed between two levels of the grid. A busy machine cannot flip it: each server runs on a core
   no other run holds (tests/host_cores.py), and the bench alternates the targets pass by pass (A B B A), so what
   slows the machine slows both.
2. The gateway (partitioned, spillover at the bench's recommended threshold and share) judged against a single
   pool given the same resources: both servers in one pool of the same gateway, least-loaded - what a router
   without the crossover makes of the same two servers on the same two cores. Measured in one sweep at the
   grid's ends: at one stream the routed pair is clearly ahead (every lone stream on the speculative server,
   where the pool gives every other one to the plain server); at the top its interval reaches the pool's lower
   bound (its split is the bench's, the pool's an even one, and the bench cannot tell them apart there). Both go
   through a gateway because on these 2 cores the gateway's own CPU is the engines': what is judged is the
   routing, with the relay's cost on both sides. A pool of two servers of one kind (two plain, or two
   speculative) is the same resources too; started for a test it would cost two more vLLM starts, so its
   throughput is predicted from the sweep (twice one server's at half the load) and printed beside: at the top a
   plain pair is ahead of any split - what a speculative server costs at high load, and why time-shared and
   in-engine exist.
3. The real curve as a stand-in profile (`crossover sim curve --profile results.json --target NAME`, the
   measured-profile replay of servers/sim/results.py): its virtual throughput at each measured level lies
   within that level's interval, widened by FIT_ERROR - the replay's stated error.

Throughput is only ever compared between targets of one sweep (interleaved by level, passes alternating), so
the machine's speed cancels out; nothing here judges wall-clock speed against a number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from crossover.gateway.config import MAX_THRESHOLD
from crossover.gateway.modes import MODES, PLAIN, SPECULATIVE
from crossover.loadtest.config import DEFAULT_PASSES
from crossover.loadtest.crossover import interpolate
from tests.loadtest.test_bench import bench, virtual_curve

GRID = [1, 2, 4, 16, 64]
ROUTED_GRID = [GRID[0], GRID[-1]]  # where routing has one right answer each: all speculative, all plain
INPUT_LEN = 32
# Long enough that the decode speed, where speculation differs, outweighs the first token (its prefill and the
# draft's are ~40 ms slower speculative); shortened on a slow host down to MIN_OUTPUT_LEN.
OUTPUT_LEN = 128
MIN_OUTPUT_LEN = 32
# Each pass of a level holds this many requests of the slower target at one stream (at C=1 a count of requests
# would be a handful, whose interval the machine's noise widens into a tie), within [MIN, MAX]_WINDOW_S.
REQUESTS_PER_PASS = 2
MIN_WINDOW_S = 4.0
MAX_WINDOW_S = 30.0
# A step at C streams takes at most (1 + C / BATCH_DISCOUNT) times a step at one (the bench's time limit only).
BATCH_DISCOUNT = 4
# The bench's time limit: its estimated length times this, plus the probes and start.
BENCH_SLACK = 3.0
BENCH_BASE_S = 60.0
# The measured profile replays each level's mean TPOT and TTFT; what it cannot replay is their spread and the
# window's edges (the bench counts tokens that arrived inside it). Measured here: within 5% at C=1 and 64.
FIT_ERROR = 0.15


@dataclass(frozen=True)
class Sweep:
    """The bench's sizes for this host, from the time per token each server took at one stream."""

    output_len: int
    window_s: float  # --duration-per-level: every pass of a level gets its share
    token_s: float  # the slower server's

    @classmethod
    def for_host(cls, token_s: dict[str, float]) -> Sweep:
        slowest = max(token_s.values())
        rates = ", ".join(f"{mode} {1 / seconds:.1f} tok/s" for mode, seconds in token_s.items())
        if token_s[SPECULATIVE] >= token_s[PLAIN]:
            pytest.skip(
                f"this host cannot show a crossover: at one stream {rates} (measured at start-up) - speculation "
                "does not pay on its CPU (AVX2-only ones, for one), so there is nothing for the sweep to find"
            )
        output_len = OUTPUT_LEN
        while output_len > MIN_OUTPUT_LEN and REQUESTS_PER_PASS * output_len * slowest > MAX_WINDOW_S:
            output_len //= 2
        pass_s = REQUESTS_PER_PASS * output_len * slowest
        if pass_s > MAX_WINDOW_S:
            pytest.skip(
                f"this host is too slow for the sweep: {REQUESTS_PER_PASS} requests of {output_len} tokens at one "
                f"stream take {pass_s:.0f} s, over the {MAX_WINDOW_S:g} s a window may take ({rates})"
            )
        return cls(output_len, DEFAULT_PASSES * max(MIN_WINDOW_S, pass_s), slowest)

    def time_limit(self, grid: list[int], targets: int) -> float:
        """Seconds the bench may take: each level's passes, each a warm-up (C requests of up to output_len
        tokens) and its window share, for every target, times BENCH_SLACK."""
        warmup_s = [self.output_len * self.token_s * (1 + c / BATCH_DISCOUNT) for c in grid]
        level_s = [DEFAULT_PASSES * warm + self.window_s for warm in warmup_s]
        return BENCH_BASE_S + BENCH_SLACK * targets * math.fsum(level_s)

    def run(self, out, targets: dict[str, str], grid: list[int]) -> dict:
        limit = self.time_limit(grid, len(targets))
        print(f"bench: output {self.output_len} tokens, windows {self.window_s:.0f} s, at most {limit:.0f} s")
        return bench(
            out, targets, grid, self.output_len, INPUT_LEN, "--duration-per-level", f"{self.window_s:g}", timeout=limit
        )


def by_level(run: dict) -> dict[tuple[str, int], dict]:
    return {(level["target"], level["concurrency"]): level for level in run["levels"]}


@pytest.fixture(scope="module")
def sweep(real_vllm) -> Sweep:
    return Sweep.for_host(real_vllm.token_s())


@pytest.fixture(scope="module")
def direct_run(real_vllm, sweep, tmp_path_factory):
    targets = {mode: real_vllm.servers[mode].url for mode in MODES}
    out = tmp_path_factory.mktemp("bench-direct")
    return out, sweep.run(out, targets, GRID)


def test_bench_finds_speculative_ahead_at_one_stream_and_plain_at_the_top_and_places_the_crossing(direct_run):
    _, run = direct_run
    for (target, c), level in by_level(run).items():
        assert level["failed"] == 0, (target, c, level["errors"])
    section = run["crossover"]
    verdicts = {row["concurrency"]: row["verdict"] for row in section["evidence"]}
    low, top = GRID[0], GRID[-1]
    assert verdicts[low] == SPECULATIVE, f"EAGLE-3 not clearly ahead at C={low}: {section['evidence']}"
    assert verdicts[top] == PLAIN, f"plain not clearly ahead at C={top}: {section['evidence']}"
    # Between them: crossed (speculative clearly ahead at one level, plain at the next) or, where levels in
    # between are ties, placed within the bracket of the last clear speculative and the first clear plain level.
    assert section["status"] in ("crossed", "within_noise"), section
    bracket_low, bracket_high = section["bracket"]
    assert verdicts[bracket_low] == SPECULATIVE and verdicts[bracket_high] == PLAIN, section
    print(f"crossing between C={bracket_low} and C={bracket_high} ({section['status']}, {section['concurrency']})")
    if section["status"] == "crossed":
        assert bracket_low <= section["concurrency"] <= bracket_high
        assert section["recommended_threshold"]["switch"] is not None


def test_the_gateway_at_the_benchs_threshold_beats_one_pool_of_the_same_servers(
    direct_run, real_vllm, vllm_gateway, sweep, tmp_path
):
    _, first = direct_run
    threshold = first["crossover"]["recommended_threshold"]["spillover"]
    share = first["crossover"]["spillover_share"]
    assert threshold is not None and share is not None, first["crossover"]
    both = [real_vllm.servers[mode].url for mode in MODES]
    one_pool = {"speculative": {"backends": both, "engine": "vllm"}, "plain": {"backends": both, "engine": "vllm"}}
    gateways = {
        "routed": vllm_gateway(policy="spillover", threshold=threshold, spillover_share=share),
        "one pool": vllm_gateway(policy="spillover", threshold=MAX_THRESHOLD, pools=one_pool),  # least-loaded
    }
    levels = by_level(sweep.run(tmp_path, {name: f"{gw.url}/v1" for name, gw in gateways.items()}, ROUTED_GRID))
    curves = {mode: {c: by_level(first)[mode, c]["output_throughput"] for c in GRID} for mode in MODES}
    for c in ROUTED_GRID:
        routed, pool = levels["routed", c], levels["one pool", c]
        assert routed["failed"] == pool["failed"] == 0, (routed["errors"], pool["errors"])
        (routed_low, routed_high), (pool_low, pool_high) = (
            level["output_throughput_interval"] for level in (routed, pool)
        )
        pairs = ", ".join(f"two {mode} {2 * interpolate(curves[mode], c / 2):.0f}" for mode in MODES)
        print(
            f"C={c}: routed {routed['output_throughput']:.0f} [{routed_low:.0f}, {routed_high:.0f}] tok/s, one pool "
            f"of both {pool['output_throughput']:.0f} [{pool_low:.0f}, {pool_high:.0f}]; threshold {threshold}, "
            f"share {share}; predicted from the sweep: {pairs}"
        )
        if c == ROUTED_GRID[0]:
            assert routed_low > pool_high, f"the routed pair not clearly ahead at one stream: {routed}, {pool}"
        else:
            assert routed_high >= pool_low, (c, routed, pool)


@pytest.mark.parametrize("target", MODES)
def test_a_stand_in_fitted_to_the_real_curve_reproduces_it(direct_run, sweep, target):
    out, run = direct_run
    virtual = virtual_curve(str(out / "results.json"), GRID, sweep.output_len, INPUT_LEN, "--target", target)
    for c in GRID:
        level = by_level(run)[target, c]
        low, high = level["output_throughput_interval"]
        print(
            f"{target} C={c}: measured {level['output_throughput']:.0f} [{low:.0f}, {high:.0f}], "
            f"stand-in {virtual[c]:.0f} tok/s"
        )
        assert low * (1 - FIT_ERROR) <= virtual[c] <= high * (1 + FIT_ERROR), (target, c, level, virtual[c])
