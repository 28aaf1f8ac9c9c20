"""The files under deploy/, read the way the tests need them: paths, YAML documents, PromQL expressions."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
PROMETHEUS_DIR = DEPLOY / "prometheus"
PROMETHEUS_CONFIG = PROMETHEUS_DIR / "prometheus.yml"
RULE_FILES = (PROMETHEUS_DIR / "rules.yml", PROMETHEUS_DIR / "alerts.yml")
DASHBOARD = DEPLOY / "grafana" / "crossover.json"
SYSTEMD_DIR = DEPLOY / "systemd"
K8S_DIR = DEPLOY / "k8s"
DOCKERFILE = DEPLOY / "Dockerfile"

# What Grafana substitutes before a query reaches Prometheus; any valid duration parses the same way.
GRAFANA_INTERVALS = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "1h"}


def rule_groups() -> list[dict]:
    """Every rule group of deploy/prometheus, recording rules first."""
    return [group for path in RULE_FILES for group in yaml.safe_load(path.read_text())["groups"]]


def rules() -> list[dict]:
    return [rule for group in rule_groups() for rule in group["rules"]]


def recorded_names() -> set[str]:
    return {rule["record"] for rule in rules() if "record" in rule}


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_panels() -> list[dict]:
    """Every panel, rows' nested panels included."""
    panels = []
    for panel in dashboard()["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))
    return panels


def dashboard_exprs() -> list[str]:
    """Every PromQL expression of the dashboard, with Grafana's interval variables replaced by durations."""
    exprs = []
    for panel in dashboard_panels():
        for target in panel.get("targets", []):
            expr = target["expr"]
            for variable, duration in GRAFANA_INTERVALS.items():
                expr = expr.replace(variable, duration)
            exprs.append(expr)
    return exprs


def k8s_documents() -> list[tuple[Path, dict]]:
    """(file, document) for every manifest under deploy/k8s."""
    return [
        (path, document)
        for path in sorted(K8S_DIR.glob("*.yaml"))
        for document in yaml.safe_load_all(path.read_text())
        if document
    ]


# PromQL words that look like metric names but are not: aggregations, functions' keywords, set operators.
_KEYWORDS = {
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk", "quantile",
    "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "offset",
    "inf", "nan",
}  # fmt: skip
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_BRACES = re.compile(r"\{[^}]*\}")
_RANGE = re.compile(r"\[[^\]]*\]")
_LABEL_LIST = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENTIFIER = re.compile(r"(?<![\w.:])([A-Za-z_:][\w:]*)(\s*\()?")


def metric_names(expr: str) -> set[str]:
    """Metric names an expression selects (no full PromQL parser: enough for the expressions we write).

    >>> sorted(metric_names('sum by (pool) (rate(crossover_requests_total{outcome="ok"}[5m])) > 0.5 * up'))
    ['crossover_requests_total', 'up']
    """
    expr = _STRING.sub('""', expr)
    expr = _BRACES.sub("", expr)
    expr = _RANGE.sub("", expr)
    expr = _LABEL_LIST.sub(r"\1", expr)
    names = set()
    for match in _IDENTIFIER.finditer(expr):
        name, call = match.groups()
        if call or name.lower() in _KEYWORDS or re.fullmatch(r"\d", name[:1]):
            continue
        names.add(name)
    return names
