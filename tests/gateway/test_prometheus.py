"""The metrics path as operators run it: a real Prometheus server scrapes the gateway's /metrics.

CI installs Debian's `prometheus` (.ci/run); a developer machine without it skips this file.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import httpx
import pytest

from crossover.servers.process import free_port, spawn, stop, wait_ready
from tests.gateway.gateway_helpers import chat

PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(
    PROMETHEUS is None and not os.environ.get("CI"), reason="Debian package `prometheus` is not installed"
)
QUERY_TIMEOUT_S = 30.0


@pytest.fixture
def prometheus(tmp_path):
    """Start Prometheus scraping `target` every second; yields its base URL."""
    started: list[subprocess.Popen] = []

    def start(target: str) -> str:
        assert PROMETHEUS, "prometheus is not installed (CI installs it in .ci/run)"
        port = free_port()
        config = tmp_path / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            "scrape_configs:\n  - job_name: crossover\n    static_configs:\n"
            f"      - targets: ['{target}']\n"
        )
        proc = spawn(
            [
                PROMETHEUS,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            die_with_parent=False,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        started.append(proc)
        url = f"http://127.0.0.1:{port}"
        wait_ready(f"{url}/-/ready", proc, QUERY_TIMEOUT_S)
        return url

    yield start
    stop(started)


def query(prometheus_url: str, expr: str) -> dict[str, float]:
    """Instant query -> {pool label (or ''): value}."""
    reply = httpx.get(f"{prometheus_url}/api/v1/query", params={"query": expr}, timeout=5).json()
    assert reply["status"] == "success", reply
    return {item["metric"].get("pool", ""): float(item["value"][1]) for item in reply["data"]["result"]}


def wait_for_query(prometheus_url: str, expr: str, expected: dict[str, float]) -> None:
    deadline = time.monotonic() + QUERY_TIMEOUT_S
    seen: dict[str, float] = {}
    while time.monotonic() < deadline:
        seen = query(prometheus_url, expr)
        if seen == expected:
            return
        time.sleep(0.2)
    raise AssertionError(f"{expr}: Prometheus has {seen}, expected {expected}")


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
