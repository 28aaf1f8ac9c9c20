"""deploy/grafana/crossover.json: importable anywhere (datasource chosen by a variable), every query valid PromQL.

Expressions are parsed by promtool (as recording rules); the e2e test (test_prometheus_e2e.py) also has a real
Prometheus evaluate each one against live data.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from tests.deploy.deploy_files import dashboard, dashboard_exprs, dashboard_panels

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
PROMTOOL_TIMEOUT_S = 60.0


def _datasource_refs(node, path="$"):
    """Every (json path, value) of a `datasource` key anywhere in the dashboard."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "datasource":
                yield path, value
            yield from _datasource_refs(value, f"{path}.{key}")
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _datasource_refs(value, f"{path}[{index}]")


def test_datasource_is_a_template_variable():
    variables = {variable["name"]: variable for variable in dashboard()["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"


def test_every_panel_and_query_uses_the_datasource_variable():
    panels = [panel for panel in dashboard_panels() if panel["type"] != "row"]
    assert panels
    for panel in panels:
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], f"{panel['title']} has no query"
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, panel["title"]
    hard_coded = [(path, ref) for path, ref in _datasource_refs(dashboard()) if ref != DATASOURCE]
    assert not hard_coded, f"datasource references other than the variable: {hard_coded}"


def test_panels_have_unique_ids_and_fit_the_grid():
    panels = dashboard_panels()
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids))
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]


def test_the_issue_panels_are_there():
    titles = " | ".join(panel["title"].lower() for panel in dashboard_panels())
    for words in (
        "in-flight per pool vs threshold",
        "routing decisions",
        "requests by outcome",
        "time to first token",
        "request duration",
        "output tokens/s per pool",
        "backend health",
        "active mode",
        "mode switches",
        "running requests",
        "queued requests",
        "accept length",
        "generation throughput",
    ):
        assert words in titles, words


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian package `prometheus`) is not installed")
def test_every_expression_parses(tmp_path):
    # promtool has no "parse this expression" command; a recording rule per expression is parsed the same way.
    exprs = dashboard_exprs()
    rules = [{"record": f"dashboard:expr_{index}", "expr": expr} for index, expr in enumerate(exprs)]
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = subprocess.run(
        ["promtool", "check", "rules", str(path)],
        capture_output=True,
        text=True,
        timeout=PROMTOOL_TIMEOUT_S,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(exprs)} rules found" in result.stdout
