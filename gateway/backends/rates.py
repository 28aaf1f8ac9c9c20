"""The live rate table: how fast each pool streams tokens at each load, measured on the traffic the gateway relays.

    rates = RateTable()
    rates.add("speculative", level=5, prompt_tokens=900, tokens=128, seconds=2.0)   # at a request's end
    rates.state("speculative")       # /admin/state's `rate_table`: by level, by prompt length, and both

What a request adds (once, at its end, if it ended well with a `usage` count): its completion tokens, its duration
(arrival to last byte, the duration `crossover_request_duration_seconds` observes), its *level* and its prompt length.
- level: the requests in flight on its backend through this gateway (this worker, under `--workers`) when it took
  its place there, itself included - the batch the engine ran it in, as far as this gateway can tell. Buckets are
  powers of two: 1, 2-3, 4-7, ..., 256-511, 512+.
- prompt length: `usage.prompt_tokens`, in buckets by powers of four: <128, 128-511, 512-2047, 2048-8191,
  8192-32767, 32768+.

"Tokens/s at level L" is the per-stream rate of the requests that ran at level L: the sum of their completion tokens
over the sum of their durations (so queueing and prefill count against it, as a client sees them; a long request
weighs more than a short one). Times L it is the pool's throughput at that load, the curve `crossover bench` draws.
Counted since start: `/metrics` has the sums (`crossover_pool_stream_*_total{pool,level}`), whose `rate()` over a
window gives the same figure for that window, added up over a host's workers.

The request path adds four numbers to a fixed array (no lock: the event loop is one thread; no allocation: an
`array('d')` made at start); what they mean is worked out when `state` is asked.
"""

from __future__ import annotations

from array import array

from crossover.gateway.config import POOL_NAMES

LEVEL_BUCKETS = 10  # 1, 2-3, ..., 256-511, 512+
PROMPT_BUCKETS = 6  # <128, 128-511, ..., 32768+
PROMPT_FIRST = 128  # the first prompt bucket's upper bound; each next one is 4x
FIELDS = 3  # requests, tokens, seconds
REQUESTS, TOKENS, SECONDS = range(FIELDS)


def level_bucket(level: int) -> int:
    bucket = level.bit_length() - 1
    return 0 if bucket < 0 else LEVEL_BUCKETS - 1 if bucket >= LEVEL_BUCKETS else bucket


def prompt_bucket(prompt_tokens: int) -> int:
    # 128 has 8 bits: (8 - 6) >> 1 == 1; 512 (10 bits) is 2; and so on, four times wider each.
    bucket = (prompt_tokens.bit_length() - 6) >> 1
    return 0 if bucket < 0 else PROMPT_BUCKETS - 1 if bucket >= PROMPT_BUCKETS else bucket


def level_bounds(bucket: int) -> tuple[int, int | None]:
    """(lowest, highest) level of a bucket; None: no upper bound."""
    return 1 << bucket, None if bucket == LEVEL_BUCKETS - 1 else (2 << bucket) - 1


def prompt_bounds(bucket: int) -> tuple[int, int | None]:
    """(lowest, highest) prompt length of a bucket; None: no upper bound."""
    low = 0 if bucket == 0 else PROMPT_FIRST << (2 * (bucket - 1))
    return low, None if bucket == PROMPT_BUCKETS - 1 else (PROMPT_FIRST << (2 * bucket)) - 1


def bucket_name(bounds: tuple[int, int | None]) -> str:
    low, high = bounds
    return f"{low}+" if high is None else str(low) if low == high else f"{low}-{high}"


LEVEL_NAMES = tuple(bucket_name(level_bounds(bucket)) for bucket in range(LEVEL_BUCKETS))
PROMPT_NAMES = tuple(bucket_name(prompt_bounds(bucket)) for bucket in range(PROMPT_BUCKETS))


class RateTable:
    """Per pool, a level x prompt-length grid of (requests, tokens, seconds); see the module docstring."""

    __slots__ = ("cells",)

    def __init__(self) -> None:
        self.cells: dict[str, array] = {
            pool: array("d", bytes(8 * LEVEL_BUCKETS * PROMPT_BUCKETS * FIELDS)) for pool in POOL_NAMES
        }

    def add(self, pool: str, level: int, prompt_tokens: int, tokens: int, seconds: float) -> None:
        """One request that ended well: on the request path, so a few stores into the pool's array and nothing more."""
        cells = self.cells.get(pool)
        if cells is None:
            return
        at = (level_bucket(level) * PROMPT_BUCKETS + prompt_bucket(prompt_tokens)) * FIELDS
        cells[at] += 1
        cells[at + 1] += tokens
        cells[at + 2] += seconds

    def cell(self, pool: str, level: int, prompt: int) -> tuple[float, float, float]:
        """(requests, tokens, seconds) of one cell, by bucket index."""
        at = (level * PROMPT_BUCKETS + prompt) * FIELDS
        cells = self.cells[pool]
        return cells[at], cells[at + 1], cells[at + 2]

    def by_level(self, pool: str) -> list[tuple[float, float, float]]:
        """(requests, tokens, seconds) of each level bucket, over every prompt length."""
        prompts = range(PROMPT_BUCKETS)
        return [_sum(self.cell(pool, level, prompt) for prompt in prompts) for level in range(LEVEL_BUCKETS)]

    def by_prompt(self, pool: str) -> list[tuple[float, float, float]]:
        """(requests, tokens, seconds) of each prompt-length bucket, over every level."""
        levels = range(LEVEL_BUCKETS)
        return [_sum(self.cell(pool, level, prompt) for level in levels) for prompt in range(PROMPT_BUCKETS)]

    def state(self, pool: str) -> dict:
        """/admin/state's `rate_table` of one pool: the buckets that saw a request, with their counts and tok/s."""
        levels = [
            {"level": LEVEL_NAMES[bucket], **_row(sums)}
            for bucket, sums in enumerate(self.by_level(pool))
            if sums[REQUESTS]
        ]
        prompts = [
            {"prompt_tokens": PROMPT_NAMES[bucket], **_row(sums)}
            for bucket, sums in enumerate(self.by_prompt(pool))
            if sums[REQUESTS]
        ]
        cells = [
            {"level": LEVEL_NAMES[level], "prompt_tokens": PROMPT_NAMES[prompt], **_row(sums)}
            for level in range(LEVEL_BUCKETS)
            for prompt in range(PROMPT_BUCKETS)
            if (sums := self.cell(pool, level, prompt))[REQUESTS]
        ]
        return {"by_level": levels, "by_prompt_tokens": prompts, "cells": cells}


def _sum(rows) -> tuple[float, float, float]:
    requests = tokens = seconds = 0.0
    for row in rows:
        requests += row[REQUESTS]
        tokens += row[TOKENS]
        seconds += row[SECONDS]
    return requests, tokens, seconds


def _row(sums: tuple[float, float, float]) -> dict:
    requests, tokens, seconds = sums
    return {
        "requests": int(requests),
        "tokens": int(tokens),
        "seconds": round(seconds, 6),
        "tokens_per_s": round(tokens / seconds, 3) if seconds > 0 else None,
    }
