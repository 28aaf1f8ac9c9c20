"""The metrics path as operators run it: a real Prometheus server scrapes the gateway's /metrics.

CI installs Debian's `prometheus` (.ci/run); a developer machine without it skips this file.
tests/deploy/test_prometheus_e2e.py runs deploy/prometheus's config and rules the same way.
"""

from __future__ import annotations

from contextlib import ExitStack

import httpx
import pytest

from tests.gateway.gateway_helpers import chat
from tests.prometheus_server import requires_prometheus, running_prometheus, scrape_every_second, wait_for_query

pytestmark = requires_prometheus


@pytest.fixture
def prometheus(tmp_path):
    """Start Prometheus scraping `target` every second; yields its base URL."""
    with ExitStack() as stack:

        def start(target: str) -> str:
            return stack.enter_context(running_prometheus(scrape_every_second({"crossover": [target]}), tmp_path))

        yield start


def test_prometheus_scrapes_routing_and_request_metrics(sims, gateway, prometheus):
    speculative, plain = sims
    gw = gateway([speculative.url], [plain.url], policy="spillover", threshold=5)
    with httpx.Client(base_url=gw.url, timeout=30) as client:
        for _ in range(3):
            assert client.post("/v1/chat/completions", json=chat()).status_code == 200
        assert client.post("/v1/chat/completions", content=b"{not json").status_code == 400

    prom = prometheus(gw.url.removeprefix("http://"))
    wait_for_query(prom, 'up{job="crossover"}', {"": 1.0})
    wait_for_query(prom, 'sum by (pool) (crossover_requests_total{outcome="ok"})', {"speculative": 3.0})
    wait_for_query(prom, "crossover_routing_threshold", {"": 5.0})
    wait_for_query(prom, "crossover_inflight_requests", {"speculative": 0.0, "plain": 0.0})
    wait_for_query(prom, "sum by (pool) (crossover_output_tokens_total)", {"speculative": 3 * chat()["max_tokens"]})
