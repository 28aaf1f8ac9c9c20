"""A host's shared table: every worker's pools read the host's exact in-flight counts, and a scrape gets the other
workers' metrics as of the scrape (asked for, not waited for on a timer)."""

from __future__ import annotations

import asyncio
import json

from prometheus_client import CollectorRegistry, Counter

from crossover.gateway.admission import Admission
from crossover.gateway.cluster import host as host_module
from crossover.gateway.cluster.host import Host, HostPools, Worker
from crossover.gateway.config import PLAIN, SPECULATIVE, Settings

SETTINGS = Settings.model_validate(
    {"pools": {"speculative": {"backends": ["http://127.0.0.1:1"]}, "plain": {"backends": ["http://127.0.0.1:2"]}}}
)


def host_pools(tmp_path, workers: int = 2) -> list[HostPools]:
    host = Host(workers, 2, tmp_path)
    return [HostPools.from_settings(SETTINGS, worker=Worker(host, slot)) for slot in range(workers)]


def test_each_worker_reads_the_hosts_exact_counts_and_a_release_gives_back_once(tmp_path):
    one, other = host_pools(tmp_path)
    held = [one.lease(one.speculative[0]) for _ in range(3)] + [other.lease(other.speculative[0]) for _ in range(2)]
    plain = other.lease(other.plain[0])
    for pools in (one, other):
        assert (pools.pool_load(SPECULATIVE), pools.pool_load(PLAIN), pools.total_load()) == (5, 1, 6)
        assert (pools.count(pools.speculative[0]), pools.inflight(SPECULATIVE)) == (5, 5)
    held[0].release()
    held[0].release()  # once only
    held[-1].release()
    plain.release()
    for pools in (one, other):
        assert (pools.pool_load(SPECULATIVE), pools.pool_load(PLAIN)) == (3, 0)
        assert [backend.inflight for backend in pools.all()] == ([2, 0] if pools is one else [1, 0])


def published_requests(host: Host, slot: int) -> float:
    return sum(host.read(slot).get("requests", {}).values())


def test_a_scrape_gets_the_other_workers_numbers_as_of_the_scrape(tmp_path, monkeypatch):
    # No timed publishing in this test: only a scrape's asking can bring the count to the file.
    monkeypatch.setattr(host_module, "PUBLISH_S", float("inf"))

    async def scenario() -> None:
        host = Host(2, 2, tmp_path)
        scraper, other = Worker(host, 0), Worker(host, 1)
        registry = CollectorRegistry()
        requests = Counter("requests", "Requests.", registry=registry)
        other.serving()
        publishing = asyncio.create_task(other.publish_every(registry, Admission(8, 8, 1.0)))
        try:
            await scraper.gather()
            assert published_requests(host, 1) == 0
            requests.inc(3)
            await scraper.gather()
            assert published_requests(host, 1) == 3
            requests.inc()
            await scraper.gather()
            assert published_requests(host, 1) == 4
        finally:
            publishing.cancel()

    asyncio.run(scenario())


def test_a_scrape_waits_for_no_worker_that_is_not_serving_and_not_past_the_wait_for_one_that_is_stopped(
    tmp_path, monkeypatch
):
    async def scenario() -> None:
        host = Host(3, 2, tmp_path)
        scraper, stopped = Worker(host, 0), Worker(host, 1)  # worker 2 never served: its pid cell is 0
        stopped.serving()  # and never publishes, as a worker stopped by SIGSTOP
        host.published(1).write_text(json.dumps({"requests": {"x": 5.0}}))
        monkeypatch.setattr(host_module, "ANSWER_WAIT_S", 0.0)
        await scraper.gather()  # returns: the stopped worker's last file is what counts
        assert published_requests(host, 1) == 5
        assert host.waiting_for(host.asked(), 0)
        monkeypatch.setattr(host_module, "ANSWER_WAIT_S", float("inf"))
        host.retire(1)  # dead: its row no longer serves, so nobody waits for it
        await scraper.gather()

    asyncio.run(scenario())


def test_a_dead_workers_counters_stay_in_the_hosts_sum_and_its_gauges_do_not(tmp_path):
    host = Host(2, 2, tmp_path)
    Worker(host, 1).serving()
    published = {"crossover_requests": {"x": 5.0}, "crossover_cluster_leader": {"y": 1.0}}  # it led when it died
    host.published(1).write_text(json.dumps(published))
    host.retire(1)
    # A new leader's 1 is the host's one leader, not 2; what the dead worker served still counts, in its slot too.
    assert host.read(host_module.RETIRED) == {
        "crossover_requests": {"x": 5.0},
        host_module.RETIRED_BY_SLOT: {"1": 5.0},
    }
