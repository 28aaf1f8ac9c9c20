"""Named defaults of `crossover bench`; the plan they go into is a pydantic model in plan.py.

Kept free of imports so `crossover --help` does not pay for them.
"""

from __future__ import annotations

# The levels the Kimi-K2.5 deployment measured, and 50: between 30 and 70, the widest gap of that grid, is where
# EAGLE-3's crossover sits on the shipped profiles at low acceptance, and the adaptive controller reads the curves
# linearly between levels. Without 50, llama8b-h200 at acceptance 1.6 (the speculative curve falls off at 64) was
# predicted to cross at 57.5 where it crosses past 63 (servers/sim/replay_adaptive.py's llama-diurnal-24h row).
DEFAULT_CONCURRENCY = (1, 2, 5, 10, 30, 50, 70, 100, 250)
DEFAULT_OUTPUT_LEN = 512
DEFAULT_INPUT_LEN = 256
DEFAULT_CONNECT_TIMEOUT_S = 10.0
# Longest silence within one stream: a request queued behind SGLang's running cap can wait minutes for
# its first token at C=250 on real hardware.
DEFAULT_READ_TIMEOUT_S = 600.0
DEFAULT_REQUEST_TIMEOUT_S = 1800.0  # whole request, first byte to [DONE]
DEFAULT_WARMUP_ROUNDS = 1
DEFAULT_ROUNDS = 3  # default measured requests per level: this many per worker...
# ...and at least this many: a speculative server's accepted-token draws need a sample to average out.
DEFAULT_MIN_REQUESTS = 16


def default_requests(concurrency: int) -> int:
    return max(DEFAULT_ROUNDS * concurrency, DEFAULT_MIN_REQUESTS)


# Passes per level: the targets alternate (A B B A), each pass a warm-up and a window of its share of the
# level, so a machine whose speed drifts shifts every target alike and widens the intervals, not a lead.
DEFAULT_PASSES = 2
# Passes measured again per level when a stand-in fell behind during one, before the level counts as lagging.
MAX_RERUNS_PER_LEVEL = 2
