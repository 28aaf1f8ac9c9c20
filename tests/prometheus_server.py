"""A real Prometheus server for tests: started on a config, asked through its HTTP API, always stopped.

    with running_prometheus(config, tmp_path) as prom:      # config: a dict (YAML) for prometheus.yml
        wait_for_query(prom, "crossover_routing_threshold", {"": 5.0})

Used by tests/gateway/test_prometheus.py (the gateway's scrape) and tests/deploy/test_prometheus_e2e.py
(deploy/prometheus's config and rules against a gateway, stand-ins and the agent). CI installs Debian's
`prometheus` (.ci/run); a developer machine without it skips those tests (`requires_prometheus`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import yaml

from crossover.servers.process import free_port, spawn, stop, wait_ready

PROMETHEUS = shutil.which("prometheus")
requires_prometheus = pytest.mark.skipif(
    PROMETHEUS is None and not os.environ.get("CI"), reason="Debian package `prometheus` is not installed"
)
QUERY_TIMEOUT_S = 30.0
API_TIMEOUT_S = 5.0
POLL_S = 0.2


def scrape_every_second(jobs: dict[str, list[str]]) -> dict:
    """A config scraping each job's `host:port` targets every second."""
    return {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": targets}]} for job, targets in jobs.items()
        ],
    }


@contextmanager
def running_prometheus(config: dict, directory: Path) -> Iterator[str]:
    """Prometheus on a free loopback port with `config`, data in `directory`; yields its base URL."""
    assert PROMETHEUS, "prometheus is not installed (CI installs it in .ci/run)"
    port = free_port()
    path = directory / f"prometheus-{port}.yml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    log = directory / f"prometheus-{port}.log"
    with log.open("wb") as output:
        proc = spawn(
            [
                PROMETHEUS,
                f"--config.file={path}",
                f"--storage.tsdb.path={directory / f'prometheus-data-{port}'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            die_with_parent=False,
            stdout=subprocess.DEVNULL,
            stderr=output,
        )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(f"{url}/-/ready", proc, QUERY_TIMEOUT_S)
        yield url
    finally:
        stop([proc])


def api(prometheus_url: str, path: str, **params) -> dict:
    """GET /api/v1/<path>; the reply's `data`, after checking it succeeded."""
    reply = httpx.get(f"{prometheus_url}/api/v1/{path}", params=params, timeout=API_TIMEOUT_S, trust_env=False)
    body = reply.json()
    assert body["status"] == "success", body
    return body["data"]


def query(prometheus_url: str, expr: str, label: str = "pool") -> dict[str, float]:
    """Instant query -> {value of `label` (or ''): value}."""
    result = api(prometheus_url, "query", query=expr)["result"]
    return {item["metric"].get(label, ""): float(item["value"][1]) for item in result}


def wait_for_query(prometheus_url: str, expr: str, expected: dict[str, float], label: str = "pool") -> None:
    deadline = time.monotonic() + QUERY_TIMEOUT_S
    seen: dict[str, float] = {}
    while time.monotonic() < deadline:
        seen = query(prometheus_url, expr, label)
        if seen == expected:
            return
        time.sleep(POLL_S)
    raise AssertionError(f"{expr}: Prometheus has {seen}, expected {expected}")


def wait_for_samples(prometheus_url: str, expr: str) -> list[dict]:
    """Poll until `expr` returns at least one sample; return them (raw API results)."""
    deadline = time.monotonic() + QUERY_TIMEOUT_S
    while time.monotonic() < deadline:
        result = api(prometheus_url, "query", query=expr)["result"]
        if result:
            return result
        time.sleep(POLL_S)
    raise AssertionError(f"{expr}: no sample in Prometheus after {QUERY_TIMEOUT_S:g} s")
