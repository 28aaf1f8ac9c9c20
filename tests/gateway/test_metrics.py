"""/metrics: every documented metric is exposed, and its value follows the live state."""

from __future__ import annotations

import asyncio

import httpx
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.parser import text_string_to_metric_families

from crossover.gateway.admission import Admission
from crossover.gateway.backends.pools import Pools
from crossover.gateway.config import Settings
from crossover.gateway.metrics import Metrics, Spread, Tally
from crossover.gateway.topology.routing import Routing
from tests.gateway.gateway_helpers import LONG, chat, wait_until

DOCUMENTED = {
    "crossover_inflight_requests": "gauge",
    "crossover_requests": "counter",
    "crossover_routing_threshold": "gauge",
    "crossover_routing_hysteresis": "gauge",
    "crossover_routing_spillover_share": "gauge",
    "crossover_route_decisions": "counter",
    "crossover_requests_by_tier": "counter",
    "crossover_time_to_first_token_seconds": "histogram",
    "crossover_request_duration_seconds": "histogram",
    "crossover_output_tokens": "counter",
    "crossover_backend_healthy": "gauge",
    "crossover_backend_inflight_requests": "gauge",
    "crossover_backend_scraped_load": "gauge",
    "crossover_backend_accept_length": "gauge",
    "crossover_pool_stream_requests": "counter",
    "crossover_pool_stream_tokens": "counter",
    "crossover_pool_stream_seconds": "counter",
    "crossover_failovers": "counter",
    "crossover_backend_stale_connections": "counter",
    "crossover_state_file_problem": "gauge",
    "crossover_client_requests_refused": "counter",
    "crossover_backend_ejections": "counter",
    "crossover_admission_queued_requests": "gauge",
    "crossover_active_mode": "gauge",
    "crossover_mode_switches": "counter",
    "crossover_switch_duration_seconds": "histogram",
    "crossover_switch_queued_requests": "gauge",
    "crossover_switch_dropped": "counter",
    "crossover_switch_recoveries": "counter",
    "crossover_cluster_connected": "gauge",
    "crossover_cluster_leader": "gauge",
    "crossover_cluster_fenced": "counter",
    "crossover_adaptive_moves": "counter",
    "crossover_adaptive_predicted_crossover": "gauge",
    "crossover_adaptive_accept_length": "gauge",
}


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(url + "/metrics", timeout=10, trust_env=False).text
    families = list(text_string_to_metric_families(text))
    types = {
        family.name: family.type
        for family in families
        if family.name.startswith("crossover_") and not family.name.endswith("_created")
    }
    assert types == DOCUMENTED
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for family in families for s in family.samples}


def test_metrics_follow_requests_through_the_gateway(sims, gateway):
    speculative, plain = sims
    gw = gateway([speculative.url], [plain.url], threshold=1, hysteresis=0)

    async def scenario():
        async with httpx.AsyncClient(base_url=gw.url, timeout=20, trust_env=False) as client:
            request = client.build_request("POST", "/v1/chat/completions", json=chat(True, LONG))
            held = await client.send(request, stream=True)
            samples = await asyncio.to_thread(scrape, gw.url)
            streamed = await client.post(
                "/v1/chat/completions", json=chat(True, 12, stream_options={"include_usage": True})
            )
            whole = await client.post(
                "/v1/completions", json={"model": chat()["model"], "prompt": "hi", "max_tokens": 5}
            )
            await held.aclose()
            return samples, held, streamed, whole

    during, held, streamed, whole = asyncio.run(scenario())
    assert held.headers["x-crossover-pool"] == "speculative"
    assert during[("crossover_inflight_requests", (("pool", "speculative"),))] == 1
    assert during[("crossover_inflight_requests", (("pool", "plain"),))] == 0
    assert during[("crossover_backend_inflight_requests", (("backend", speculative.url), ("pool", "speculative")))] == 1
    assert streamed.headers["x-crossover-pool"] == "plain" and whole.headers["x-crossover-pool"] == "plain"

    wait_until(lambda: gw.inflight() == 0)
    after = scrape(gw.url)

    def value(name: str, **labels: str) -> float:
        return after.get((name, tuple(sorted(labels.items()))), 0.0)

    assert value("crossover_inflight_requests", pool="speculative") == 0
    assert value("crossover_requests_total", pool="plain", outcome="ok") == 2
    assert value("crossover_requests_total", pool="speculative", outcome="client_disconnect") == 1
    assert value("crossover_route_decisions_total", pool="speculative", reason="below_threshold") == 1
    assert value("crossover_route_decisions_total", pool="plain", reason="above_threshold") == 2
    assert value("crossover_output_tokens_total", pool="plain") == 12 + 5  # the streamed usage event + the body
    assert value("crossover_time_to_first_token_seconds_count", pool="plain") == 1
    assert value("crossover_request_duration_seconds_count", pool="plain") == 2
    assert value("crossover_routing_threshold") == 1
    assert value("crossover_backend_healthy", backend=speculative.url, pool="speculative") == 1
    assert value("crossover_backend_healthy", backend=plain.url, pool="plain") == 1


def test_each_gateway_has_its_own_registry():
    settings = Settings(pools={"speculative": {"backends": ["http://s:1"]}, "plain": {"backends": ["http://p:2"]}})
    pools, routing = Pools.from_settings(settings), Routing.from_settings(settings)
    admission = Admission(4, 4, 1.0)
    first, second = CollectorRegistry(), CollectorRegistry()
    Metrics(first, pools, routing, admission).request_ended("plain", "ok", 0.5, 0)
    Metrics(second, pools, routing, admission)
    assert first.get_sample_value("crossover_requests_total", {"pool": "plain", "outcome": "ok"}) == 1
    assert second.get_sample_value("crossover_requests_total", {"pool": "plain", "outcome": "ok"}) is None
    pools.plain[0].inflight = 3
    assert second.get_sample_value("crossover_inflight_requests", {"pool": "plain"}) == 3


def test_the_per_request_families_expose_what_prometheus_clients_own_would():
    # Tally and Spread stand in for Counter and Histogram on the request path: same samples, same text.
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    spread = Spread("x_seconds", "x", ("pool",), (0.1, 1, 5), ours)
    histogram = Histogram("x_seconds", "x", ["pool"], buckets=(0.1, 1, 5), registry=theirs)
    tally = Tally("y", "y", ("pool", "outcome"), ours)
    counter = Counter("y", "y", ["pool", "outcome"], registry=theirs)
    for value in (0.05, 0.1, 0.7, 1.0, 4.9, 5.0, 7.5, 600.0):  # bounds themselves included: `le` is inclusive
        spread.observe(("plain",), value)
        histogram.labels("plain").observe(value)
    tally.inc(("plain", "ok"))
    tally.inc(("plain", "ok"), 2)
    counter.labels("plain", "ok").inc(3)

    def samples(registry):
        return sorted(
            (s.name, tuple(sorted(s.labels.items())), s.value)
            for family in registry.collect()
            for s in family.samples
            if not s.name.endswith("_created")
        )

    assert samples(ours) == samples(theirs)
    assert ("x_seconds_bucket", (("le", "1.0"), ("pool", "plain")), 4.0) in samples(ours)
