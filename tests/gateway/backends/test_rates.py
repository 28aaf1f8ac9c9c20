"""The live rate table: buckets, counts, and what a request adds on its way out (a fixed array's cells, no more)."""

from __future__ import annotations

import asyncio
import tracemalloc

import httpx
from prometheus_client import CollectorRegistry

from crossover.gateway.admission import Admission
from crossover.gateway.backends import LEVEL_NAMES, PROMPT_NAMES, Backend, Pools, RateTable
from crossover.gateway.backends import rates as rates_module
from crossover.gateway.backends.pools import Lease
from crossover.gateway.config import Settings
from crossover.gateway.metrics import OK, Metrics
from crossover.gateway.topology import Routing
from tests.gateway.gateway_helpers import MODEL, SIM_SCALE, chat


def test_buckets_are_powers_of_two_for_level_and_of_four_for_prompt_length():
    assert LEVEL_NAMES == ("1", "2-3", "4-7", "8-15", "16-31", "32-63", "64-127", "128-255", "256-511", "512+")
    assert PROMPT_NAMES == ("0-127", "128-511", "512-2047", "2048-8191", "8192-32767", "32768+")
    level, prompt = rates_module.level_bucket, rates_module.prompt_bucket
    assert [level(n) for n in (0, 1, 2, 3, 4, 7, 8, 511, 512, 10**6)] == [0, 0, 1, 1, 2, 2, 3, 8, 9, 9]
    assert [prompt(n) for n in (0, 127, 128, 511, 512, 2047, 2048, 32767, 32768, 10**7)] == [
        0,
        0,
        1,
        1,
        2,
        2,
        3,
        4,
        5,
        5,
    ]


def test_state_counts_each_request_once_in_its_cell_and_rates_are_tokens_over_seconds():
    table = RateTable()
    table.add("speculative", 1, 100, 100, 2.0)
    table.add("speculative", 1, 100, 50, 0.5)
    table.add("speculative", 3, 600, 30, 1.0)
    table.add("plain", 40, 40_000, 10, 1.0)
    table.add("none", 1, 1, 1, 1.0)  # no pool: not a pool's rate
    state = table.state("speculative")
    assert state["by_level"] == [
        {"level": "1", "requests": 2, "tokens": 150, "seconds": 2.5, "tokens_per_s": 60.0},
        {"level": "2-3", "requests": 1, "tokens": 30, "seconds": 1.0, "tokens_per_s": 30.0},
    ]
    assert [(row["prompt_tokens"], row["requests"]) for row in state["by_prompt_tokens"]] == [
        ("0-127", 2),
        ("512-2047", 1),
    ]
    assert [(row["level"], row["prompt_tokens"], row["requests"]) for row in state["cells"]] == [
        ("1", "0-127", 2),
        ("2-3", "512-2047", 1),
    ]
    plain = table.state("plain")
    assert [(row["level"], row["prompt_tokens"]) for row in plain["cells"]] == [("32-63", "32768+")]
    assert sum(row["requests"] for row in state["by_level"]) == sum(row["requests"] for row in state["cells"]) == 3


def test_the_request_path_adds_no_lock_and_allocates_nothing_per_request():
    """What a request's end adds for the rate table: its lease's level (a slot set as the lease is taken) and four
    stores into an array made at start - nothing that grows per request, and no lock anywhere in the module."""
    source = rates_module.__loader__.get_source(rates_module.__name__)
    assert "threading" not in source and "Lock" not in source
    assert not hasattr(RateTable(), "__dict__") and "level" in Lease.__slots__
    settings = Settings(pools={"speculative": {"backends": ["http://a"]}, "plain": {"backends": ["http://b"]}})
    pools = Pools.from_settings(settings)
    metrics = Metrics(CollectorRegistry(), pools, Routing.from_settings(settings), Admission(10, 10, 1.0))
    backend: Backend = pools.speculative[0]

    def one_request() -> None:
        lease = pools.lease(backend)
        metrics.request_ended("speculative", OK, 0.25, 64, lease.level, 1000)
        lease.release()

    for _ in range(100):  # every label key and bucket already exists
        one_request()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(10_000):
            one_request()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 1024, f"{grown} bytes kept over 10,000 requests"
    assert pools.rates.state("speculative")["by_level"][0]["requests"] == 10_100


def test_the_gateway_counts_relayed_requests_by_level_and_prompt_length(sim, gateway):
    spec, plain = sim("k25-eagle3", *SIM_SCALE), sim("k25-plain", *SIM_SCALE)
    gw = gateway([spec.url], [plain.url], threshold=1000)  # everything to the speculative pool
    long_prompt = {"model": MODEL, "prompt": "x " * 800, "max_tokens": 16, "stream": False}
    with httpx.Client(timeout=60, trust_env=False) as client:
        for _ in range(3):  # one at a time: level 1
            client.post(gw.url + "/v1/chat/completions", json=chat(max_tokens=16)).raise_for_status()
        client.post(gw.url + "/v1/completions", json=long_prompt).raise_for_status()
        streamed = chat(stream=True, max_tokens=16, stream_options={"include_usage": True})
        client.post(gw.url + "/v1/chat/completions", json=streamed).raise_for_status()

    async def together(n: int) -> None:
        async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
            answers = await asyncio.gather(
                *(client.post(gw.url + "/v1/chat/completions", json=chat(max_tokens=200)) for _ in range(n))
            )
            for answer in answers:
                answer.raise_for_status()

    asyncio.run(together(4))
    gw.settled()
    table = gw.state.snapshot()["pools"]["speculative"]["rate_table"]
    by_level = {row["level"]: row for row in table["by_level"]}
    assert sum(row["requests"] for row in by_level.values()) == 9
    assert by_level["1"]["requests"] >= 5  # the sequential ones, and the first of the four
    assert set(by_level) <= {"1", "2-3", "4-7"} and by_level["1"]["tokens_per_s"] > 0
    assert sum(row["tokens"] for row in by_level.values()) == 5 * 16 + 4 * 200
    prompts = {row["prompt_tokens"]: row["requests"] for row in table["by_prompt_tokens"]}
    assert prompts["0-127"] == 8 and sum(prompts.values()) == 9 and len(prompts) == 2  # the long prompt elsewhere
    for row in table["by_level"]:  # /metrics says the same, summed over prompt lengths
        labels = {"pool": "speculative", "level": row["level"]}
        assert gw.metric("crossover_pool_stream_requests_total", **labels) == row["requests"]
        assert gw.metric("crossover_pool_stream_tokens_total", **labels) == row["tokens"]
    assert gw.state.snapshot()["pools"]["plain"]["rate_table"]["by_level"] == []
