"""The closed loop: C workers back to back, the planned number of requests, failures counted."""

from __future__ import annotations

import asyncio

import pytest

from crossover.loadtest.config import MAX_RERUNS_PER_LEVEL, default_requests
from crossover.loadtest.plan import LoadSettings, Target
from crossover.loadtest.runner import run_level, run_sweep
from crossover.loadtest.workload import Workload
from tests.loadtest.scripted_backend import CHUNKS, TOKENS_PER_CHUNK

LOAD = LoadSettings(request_timeout_s=30.0)
# Time enters where tests/timing.py cannot see it: the paced backend sleeps between chunks, a level's window
# and its measured concurrency are on the wall's clock.
pytestmark = pytest.mark.timing


def workload(model: str) -> Workload:
    return Workload(model=model, output_len=CHUNKS * TOKENS_PER_CHUNK, input_len=32)


@pytest.mark.parametrize("concurrency", [1, 4, 16])
def test_level_keeps_exactly_c_requests_in_flight_and_measures_the_planned_number(scripted, concurrency):
    url, app = scripted
    seen = []
    level = asyncio.run(run_level(Target(name="t", url=url), concurrency, workload("paced"), LOAD, seen.append))
    planned = default_requests(concurrency)
    assert (level.completed, level.failed) == (planned, 0)
    assert len(seen) == concurrency + planned  # one warm-up round, then the measured requests
    # At most C - 1 requests were still running when the window closed; they were cancelled.
    assert concurrency + planned <= app.requests <= planned + 2 * concurrency - 1
    assert app.peak == concurrency  # never more than C, and the loop did reach C
    # The mean in flight is over wall time: a client starved of CPU resends late (14.0 of 16 beside CPU
    # burners), so only its bound is the loop's; the exact count is the peak above.
    assert 0 < level.measured_concurrency <= concurrency
    tokens = level.total_output_tokens
    assert planned * CHUNKS * TOKENS_PER_CHUNK <= tokens <= (planned + concurrency) * CHUNKS * TOKENS_PER_CHUNK


def test_duration_mode_measures_a_timed_window_after_the_warm_up(scripted):
    url, app = scripted
    load = LoadSettings(duration_s=0.3, request_timeout_s=30.0)
    level = asyncio.run(run_level(Target(name="t", url=url), 2, workload("paced"), load))
    assert level.completed >= 1 and level.failed == 0
    # Two warm-up requests before the window, at most two cancelled when it closed.
    assert level.completed + 2 <= app.requests <= level.completed + 4
    assert level.duration_s >= 0.3


def test_mid_stream_errors_are_failures_with_no_throughput(scripted):
    url, _ = scripted
    level = asyncio.run(run_level(Target(name="t", url=url), 3, workload("error-mid"), LoadSettings(requests=9)))
    assert (level.completed, level.failed) == (0, 9)
    assert level.output_throughput == 0.0 and level.median_ttft_ms is None
    assert level.errors == {"stream error event: 503: The request queue is full.": 9}


def test_sweep_interleaves_targets_level_by_level_and_pass_by_pass(scripted):
    url, _ = scripted
    targets = [Target(name="a", url=url), Target(name="b", url=f"{url}/v1")]
    order = []
    levels = asyncio.run(
        run_sweep(
            targets,
            [1, 2],
            workload("ok"),
            LoadSettings(requests=3, passes=2),
            on_level_start=lambda target, c, planned: order.append((target.name, c, planned)),
        )
    )
    # A B B A at each level; each pass measures its share of the level (2 of 3) after a warm-up round of C.
    assert order == [
        ("a", 1, 3),
        ("b", 1, 3),
        ("b", 1, 3),
        ("a", 1, 3),
        ("a", 2, 4),
        ("b", 2, 4),
        ("b", 2, 4),
        ("a", 2, 4),
    ]
    assert [(lv.target, lv.concurrency, lv.completed) for lv in levels] == [
        ("a", 1, 4),
        ("b", 1, 4),
        ("a", 2, 4),
        ("b", 2, 4),
    ]
    assert all(len(lv.pass_output_throughputs) == 2 for lv in levels)


def test_a_rejected_pass_is_measured_again_until_the_reruns_are_spent(scripted):
    url, _ = scripted
    targets = [Target(name="a", url=url), Target(name="b", url=url)]
    order, checks = [], []

    async def reject_the_first_passes(concurrency: int, index: int, may_rerun: bool) -> bool:
        checks.append((concurrency, index, may_rerun))
        return False  # a stand-in that never keeps up: kept once no rerun is left

    levels = asyncio.run(
        run_sweep(
            targets,
            [1],
            workload("ok"),
            LoadSettings(requests=2, passes=2),
            on_level_start=lambda target, c, planned: order.append(target.name),
            on_pass_done=reject_the_first_passes,
        )
    )
    reruns = [(1, 0, True)] * MAX_RERUNS_PER_LEVEL
    assert checks == [*reruns, (1, 0, False), (1, 1, False)]
    assert order == ["a", "b"] * (MAX_RERUNS_PER_LEVEL + 1) + ["b", "a"]
    assert [(lv.target, lv.completed) for lv in levels] == [("a", 2), ("b", 2)]  # only the kept passes count


def test_a_crashing_progress_hook_ends_the_level_with_its_error_instead_of_a_hang(scripted):
    url, _ = scripted

    def broken(result):
        raise RuntimeError("hook broke")

    with pytest.raises(RuntimeError, match="hook broke"):
        asyncio.run(asyncio.wait_for(run_level(Target(name="t", url=url), 4, workload("paced"), LOAD, broken), 30))
