"""deploy/prometheus end to end: a real Prometheus, configured from deploy/prometheus/prometheus.yml (targets
moved to loopback, intervals shortened) with its recording rules and alerts, scrapes a running gateway in
front of two stand-ins and the GPU-host agent; its HTTP API must show the samples, the recorded series, rules
that evaluate without error, every dashboard query answered, and an alert that goes pending when a pool dies.
A time-shared gateway's pools alert only for the active mode.
"""

from __future__ import annotations

import copy
import time
from datetime import datetime

import pytest
import yaml

from tests.deploy.conftest import THRESHOLD
from tests.deploy.deploy_files import PROMETHEUS_CONFIG, PROMETHEUS_DIR, dashboard_exprs
from tests.prometheus_server import (
    QUERY_TIMEOUT_S,
    api,
    query,
    requires_prometheus,
    running_prometheus,
    wait_for_query,
    wait_for_samples,
)

pytestmark = requires_prometheus
RULES_POLL_S = 0.2


def loopback_config(deployment) -> dict:
    """deploy/prometheus/prometheus.yml with each job's targets replaced by the test's own servers."""
    config = copy.deepcopy(yaml.safe_load(PROMETHEUS_CONFIG.read_text()))
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    config["rule_files"] = [str(PROMETHEUS_DIR / name) for name in config["rule_files"]]
    hostport = {
        "crossover-gateway": [deployment.gateway.url.removeprefix("http://")],
        "speculative": [deployment.speculative.url.removeprefix("http://")],
        "plain": [deployment.plain.url.removeprefix("http://")],
    }
    if deployment.agent is not None:
        hostport["crossover-agent"] = [deployment.agent.hostport()]
    jobs = []
    for job in config["scrape_configs"]:
        job.pop("scrape_timeout", None)  # must not exceed the 1 s interval
        if job["job_name"] == "sglang":
            for group in job["static_configs"]:
                group["targets"] = hostport[group["labels"]["pool"]]
        elif job["job_name"] in hostport:
            job["static_configs"] = [{"targets": hostport[job["job_name"]]}]
        else:
            continue  # the agent, when it is not there yet
        jobs.append(job["job_name"])
    config["scrape_configs"] = [job for job in config["scrape_configs"] if job["job_name"] in jobs]
    return config


def wait_for_rules_evaluated(prom: str) -> list[dict]:
    """Every rule of every group, once each has been evaluated at least once."""
    deadline = time.monotonic() + QUERY_TIMEOUT_S
    while True:
        rules = [rule for group in api(prom, "rules")["groups"] for rule in group["rules"]]
        if rules and all(rule["health"] != "unknown" for rule in rules):
            return rules
        assert time.monotonic() < deadline, [r["name"] for r in rules if r["health"] == "unknown"]
        time.sleep(RULES_POLL_S)


def test_prometheus_scrapes_the_deployment_and_evaluates_the_rules(deployment, tmp_path):
    config = loopback_config(deployment)
    with running_prometheus(config, tmp_path) as prom:
        up = {"crossover-gateway": 1.0, "sglang": 1.0}
        if deployment.agent is not None:
            up["crossover-agent"] = 1.0
        wait_for_query(prom, "max by (job) (up)", up, label="job")

        # The gateway's own samples, and one recording rule over them.
        wait_for_query(prom, "crossover_inflight_requests", {"speculative": 0.0, "plain": 0.0})
        wait_for_query(prom, "crossover_routing_threshold", {"": float(THRESHOLD)})
        wait_for_query(prom, "pool:crossover_inflight_requests:sum", {"speculative": 0.0, "plain": 0.0})
        assert wait_for_samples(prom, "pool:crossover_requests:rate5m")
        # SGLang's side, labelled by pool from the scrape config.
        assert set(query(prom, "sglang:num_running_reqs")) == {"speculative", "plain"}

        rules = wait_for_rules_evaluated(prom)
        broken = {rule["name"]: rule.get("lastError") for rule in rules if rule["health"] != "ok"}
        assert not broken, broken
        alerts = [rule["name"] for rule in rules if rule["type"] == "alerting"]
        assert "CrossoverPoolNoHealthyBackend" in alerts
        assert not api(prom, "alerts")["alerts"], "a healthy deployment raises no alert"

        # Every dashboard query is valid PromQL to a real Prometheus (names: test_metric_names.py).
        for expr in dashboard_exprs():
            api(prom, "query", query=expr)

        if deployment.agent is None:
            pytest.skip(f"the agent part: {deployment.agent_missing}")
        # One current state per server of the profile (which one depends on what runs on the box).
        wait_for_query(
            prom, "sum by (server) (crossover_agent_server_state)", {"speculative": 1.0, "plain": 1.0}, label="server"
        )

        # The alerts see live data: with the plain pool's only backend gone, its alert goes pending (for: 1m).
        deployment.plain.kill()
        wait_for_query(prom, 'ALERTS{alertname="CrossoverPoolNoHealthyBackend", alertstate="pending"}', {"plain": 1.0})


def wait_for_evaluation_after(prom: str, alert: str, moment: float) -> None:
    """Until the group holding `alert` has been evaluated after `moment` (Unix time)."""
    deadline = time.monotonic() + QUERY_TIMEOUT_S
    while True:
        for group in api(prom, "rules")["groups"]:
            if any(rule["name"] == alert for rule in group["rules"]):
                evaluated = datetime.fromisoformat(group["lastEvaluation"].replace("Z", "+00:00")).timestamp()
                if evaluated > moment:
                    return
        assert time.monotonic() < deadline, f"{alert} not evaluated after {moment}"
        time.sleep(RULES_POLL_S)


def test_a_time_shared_deployment_alerts_only_on_the_active_modes_pool(time_shared_deployment, tmp_path):
    deployment = time_shared_deployment
    pending = 'ALERTS{alertname="CrossoverPoolNoHealthyBackend", alertstate="pending"}'
    with running_prometheus(loopback_config(deployment), tmp_path) as prom:
        wait_for_query(prom, "crossover_active_mode", {"speculative": 1.0, "plain": 0.0}, label="mode")

        # The inactive mode's server goes away (stopped or released, in a real switch): not an alert.
        deployment.plain.kill()
        wait_for_query(prom, "max by (pool) (crossover_backend_healthy)", {"speculative": 1.0, "plain": 0.0})
        wait_for_evaluation_after(prom, "CrossoverPoolNoHealthyBackend", time.time())
        assert query(prom, pending) == {}

        # The active mode's server goes away: its pool alerts.
        deployment.speculative.kill()
        deadline = time.monotonic() + QUERY_TIMEOUT_S
        while "speculative" not in query(prom, pending):
            assert time.monotonic() < deadline, f"no pending alert for the active pool: {query(prom, pending)}"
            time.sleep(RULES_POLL_S)
