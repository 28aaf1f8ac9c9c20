"""Backends' health (circuit breaker), load signals and least-loaded choice."""

import time

import pytest

from crossover.gateway.backends.pools import Pools
from crossover.gateway.config import Settings


def make_pools(load_signal="local", failure_threshold=3, eject_seconds=30.0, plain=("http://p1:1", "http://p2:2")):
    settings = Settings(
        load_signal=load_signal,
        health={"failure_threshold": failure_threshold, "eject_seconds": eject_seconds, "load_interval": 1.0},
        pools={"speculative": {"backends": ["http://s1:1"]}, "plain": {"backends": list(plain)}},
    )
    return Pools.from_settings(settings)


def test_choose_takes_the_least_loaded_usable_backend():
    pools = make_pools()
    p1, p2 = pools.plain
    p1.inflight, p2.inflight = 3, 1
    assert pools.choose("plain") is p2
    assert pools.choose("plain", exclude={p2}) is p1
    p2.healthy = False
    assert pools.choose("plain") is p1
    p1.healthy = False
    assert pools.choose("plain") is None


def test_a_lease_counts_one_request_until_released_once():
    pools = make_pools()
    backend = pools.plain[0]
    with pools.lease(backend) as lease:
        assert backend.inflight == 1 and pools.inflight("plain") == 1
        lease.release()
        lease.release()  # idempotent: however many exits a request takes, it is counted down once
        assert backend.inflight == 0
    assert backend.inflight == 0
    try:
        with pools.lease(backend):
            raise RuntimeError("the request failed")
    except RuntimeError:
        pass
    assert backend.inflight == 0


def test_ties_are_spread():
    pools = make_pools()
    assert {pools.choose("plain").url for _ in range(4)} == {"http://p1:1", "http://p2:2"}


@pytest.mark.parametrize(("signal", "expected"), [("local", 2), ("scraped", 7), ("max", 7)])
def test_load_signals(signal, expected):
    pools = make_pools(load_signal=signal)
    backend = pools.speculative[0]
    backend.inflight = 2
    backend.scraped, backend.scraped_at = 7, time.monotonic()
    assert pools.pool_load("speculative") == expected
    assert pools.total_load() == expected


def test_stale_scraped_load_falls_back_to_local_counts():
    pools = make_pools(load_signal="scraped")
    backend = pools.speculative[0]
    backend.inflight = 2
    backend.scraped, backend.scraped_at = 7, time.monotonic() - 60
    assert pools.pool_load("speculative") == 2


def test_model_names_come_from_settings_or_backends():
    pools = make_pools()
    assert pools.model_names() == frozenset()
    pools.learned_models(pools.speculative[0], ("m",))
    assert pools.model_names() == {"m"}
