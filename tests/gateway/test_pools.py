"""Backends' health (circuit breaker), load signals and least-loaded choice."""

import time

import pytest

from crossover.gateway.config import Settings
from crossover.gateway.pools import Pools


def make_pools(load_signal="local", failure_threshold=3, eject_seconds=30.0, plain=("http://p1:1", "http://p2:2")):
    settings = Settings(
        load_signal=load_signal,
        health={"failure_threshold": failure_threshold, "eject_seconds": eject_seconds, "load_interval": 1.0},
        pools={"speculative": {"backends": ["http://s1:1"]}, "plain": {"backends": list(plain)}},
    )
    return Pools.from_settings(settings)


def test_unknown_backends_are_usable_until_a_first_failure():
    pools = make_pools()
    backend = pools.speculative[0]
    assert backend.healthy is None and backend.usable and not pools.any_healthy()
    pools.failed(backend)
    assert backend.healthy is False and not backend.usable


def test_a_healthy_backend_is_ejected_after_consecutive_failures_and_restored_by_a_probe():
    pools = make_pools(failure_threshold=3, eject_seconds=0.2)
    backend = pools.speculative[0]
    pools.succeeded(backend)
    pools.failed(backend)
    pools.failed(backend)
    pools.succeeded(backend)  # a success resets the count
    pools.failed(backend)
    pools.failed(backend)
    assert backend.healthy is True
    pools.failed(backend)
    assert backend.healthy is False
    pools.succeeded(backend, probe=True)
    assert backend.healthy is False  # the ejection runs its time
    deadline = time.monotonic() + 5
    while time.monotonic() < backend.ejected_until and time.monotonic() < deadline:
        time.sleep(0.01)
    pools.succeeded(backend, probe=True)
    assert backend.healthy is True and backend.failures == 0


def test_choose_takes_the_least_loaded_usable_backend():
    pools = make_pools()
    p1, p2 = pools.plain
    p1.inflight, p2.inflight = 3, 1
    assert pools.choose("plain") is p2
    assert pools.choose("plain", exclude={p2}) is p1
    pools.failed(p2)
    assert pools.choose("plain") is p1
    pools.failed(p1)
    assert pools.choose("plain") is None


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
    pools.speculative[0].models = ("m",)
    assert pools.model_names() == {"m"}
