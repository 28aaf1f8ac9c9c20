"""Every metric name the dashboard, the alerts and the recording rules use is exported by a live gateway, a live
stand-in (whose `sglang:` names follow SGLang 0.5.23, shared/reference/sglang.md) or the GPU-host agent.

Names come from `# TYPE` lines of /metrics, which exist from start-up even for metrics with no sample yet;
a histogram `x` exports x_bucket, x_sum and x_count, a counter `x_total` exports x_total (and x_created).
"""

from __future__ import annotations

import httpx
import pytest

from tests.deploy.deploy_files import dashboard_exprs, metric_names, recorded_names, rules
from tests.gateway.gateway_helpers import SIM_SCALE

# Made by Prometheus itself, not by a target.
PROMETHEUS_NAMES = {"up", "ALERTS", "ALERTS_FOR_STATE", "scrape_duration_seconds", "scrape_samples_scraped"}
SUFFIXES = {
    "counter": ("", "_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "untyped": ("",),
    "unknown": ("",),
}
# The gateway's metrics as agreed between the helpers of issues 7-10 (existing and being added).
GATEWAY_CONTRACT = (
    "crossover_inflight_requests", "crossover_requests_total", "crossover_route_decisions_total",
    "crossover_routing_threshold", "crossover_routing_hysteresis", "crossover_time_to_first_token_seconds",
    "crossover_request_duration_seconds", "crossover_output_tokens_total", "crossover_failovers_total",
    "crossover_backend_healthy", "crossover_backend_inflight_requests", "crossover_backend_scraped_load",
    "crossover_backend_stale_connections_total", "crossover_backend_ejections_total",
    "crossover_admission_queued_requests",
    "crossover_active_mode", "crossover_mode_switches_total", "crossover_switch_duration_seconds",
    "crossover_switch_queued_requests", "crossover_switch_dropped_total",
)  # fmt: skip
AGENT_CONTRACT = (
    "crossover_agent_server_state",
    "crossover_agent_operations_total",
    "crossover_agent_last_start_duration_seconds",
)
# SGLang 0.5.23's own metric names (shared/reference/sglang.md, from srt/metrics/collector.py): what the
# deploy files may use of SGLang, whatever the stand-in exports besides.
SGLANG_GAUGES = (
    "num_running_reqs", "num_queue_reqs", "token_usage", "num_used_tokens", "gen_throughput", "cache_hit_rate",
    "spec_accept_length", "spec_accept_rate", "spec_num_steps", "max_total_num_tokens",
)  # fmt: skip
SGLANG_HISTOGRAMS = (
    "time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds", "queue_time_seconds",
)  # fmt: skip
SGLANG_COUNTERS = (
    "prompt_tokens_total", "generation_tokens_total", "num_requests_total", "num_aborted_requests_total",
)  # fmt: skip
SGLANG_NAMES = {
    *(f"sglang:{name}" for name in SGLANG_GAUGES + SGLANG_COUNTERS),
    *(f"sglang:{name}{suffix}" for name in SGLANG_HISTOGRAMS for suffix in ("_bucket", "_sum", "_count")),
}
SCRAPE_TIMEOUT_S = 10.0


def exported(url: str) -> set[str]:
    """Every sample name /metrics can carry, from its TYPE lines."""
    text = httpx.get(f"{url}/metrics", timeout=SCRAPE_TIMEOUT_S, trust_env=False).text
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            base = name.removesuffix("_total") if kind == "counter" else name
            names |= {base + suffix for suffix in SUFFIXES[kind]}
    return names


def used() -> dict[str, set[str]]:
    """{metric name: where it is used}, recording rules' own names resolved to their definitions."""
    sources: dict[str, set[str]] = {}
    for rule in rules():
        where = f"rule {rule.get('record') or rule.get('alert')}"
        for name in metric_names(rule["expr"]):
            sources.setdefault(name, set()).add(where)
    for expr in dashboard_exprs():
        for name in metric_names(expr):
            sources.setdefault(name, set()).add("dashboard")
    return {name: where for name, where in sources.items() if name not in recorded_names() | PROMETHEUS_NAMES}


@pytest.fixture
def names(deployment) -> dict[str, set[str]]:
    """{exporter: names} from the live deployment."""
    live = {
        "gateway": exported(deployment.gateway.url),
        "stand-in": exported(deployment.speculative.url) | exported(deployment.plain.url),
    }
    if deployment.agent is not None:
        live["agent"] = exported(deployment.agent.url)
    return live


def test_every_metric_used_by_the_dashboard_and_rules_is_exported(names):
    everything = set().union(*names.values())
    missing = {name: sorted(where) for name, where in sorted(used().items()) if name not in everything}
    assert not missing, f"used but exported by none of {sorted(names)}: {missing}"


def test_the_gateway_and_the_agent_export_every_contract_metric(deployment, names):
    missing = [name for name in GATEWAY_CONTRACT if not {name, name + "_bucket"} & names["gateway"]]
    assert not missing, f"the gateway does not export: {missing}"
    if deployment.agent is None:
        pytest.skip(deployment.agent_missing)
    missing = [name for name in AGENT_CONTRACT if name not in names["agent"]]
    assert not missing, f"the agent does not export: {missing}"


def test_the_stand_in_exports_sglang_names(sim):
    names = exported(sim("k25-eagle3", *SIM_SCALE).url)
    for name in (
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:spec_accept_length",
        "sglang:gen_throughput",
        "sglang:token_usage",
        "sglang:generation_tokens_total",
        "sglang:time_to_first_token_seconds_bucket",
    ):
        assert name in names


def test_sglang_names_used_are_real_sglang_names():
    # The stand-in could export a name real SGLang does not: a panel on it would stay empty in production.
    invented = {name: sorted(where) for name, where in used().items() if name.startswith("sglang:")}
    invented = {name: where for name, where in invented.items() if name not in SGLANG_NAMES}
    assert not invented, f"not among SGLang 0.5.23's metrics: {invented}"


def test_used_names_are_found_at_all():
    # The extraction must see the metrics the rules are built on, or the test above would pass vacuously.
    assert {"crossover_requests_total", "sglang:num_queue_reqs", "crossover_agent_server_state"} <= set(used())
