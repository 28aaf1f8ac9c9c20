"""deploy/k8s: every manifest validates against the Kubernetes schemas (kubernetes-validate, offline), and the
pieces agree with each other and with the rest of the project: the gateway's settings load, commands parse
with crossover's CLI, SGLang commands are the profiles', the PrometheusRule is deploy/prometheus's rules.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess

import pytest
import yaml

from crossover.gateway.cli import build_parser
from crossover.gateway.config import load_settings
from crossover.servers.profile import load_profile
from tests.conftest import crossover_argv
from tests.deploy.deploy_files import k8s_documents, rule_groups

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is not installed (pip, in the test extras)"
)

# The oldest Kubernetes release still widely run, and the newest the validator knows.
KUBERNETES_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
OPERATOR_GROUP = "monitoring.coreos.com/"
PLAN_TIMEOUT_S = 60.0


def documents(kind: str | None = None, name: str | None = None) -> list[dict]:
    return [
        document
        for _, document in k8s_documents()
        if (kind is None or document["kind"] == kind) and (name is None or document["metadata"]["name"] == name)
    ]


def one(kind: str, name: str) -> dict:
    (document,) = documents(kind, name)
    return document


def container(workload: dict) -> dict:
    (main,) = workload["spec"]["template"]["spec"]["containers"]
    return main


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_manifests_validate_against_the_kubernetes_schemas(version):
    checked = 0
    for _, document in k8s_documents():
        if document["apiVersion"].startswith(OPERATOR_GROUP):
            continue  # no schema offline: see test_operator_resources_have_no_offline_schema
        kubernetes_validate.validate(document, version, strict=True)
        checked += 1
    assert checked >= 10


def test_the_validator_rejects_a_misspelled_field():
    deployment = copy.deepcopy(one("Deployment", "crossover-gateway"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGett"] = {"path": "/health"}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[-1], strict=True)


def test_operator_resources_have_no_offline_schema():
    kinds = sorted({d["kind"] for _, d in k8s_documents() if d["apiVersion"].startswith(OPERATOR_GROUP)})
    assert kinds == ["PrometheusRule", "ServiceMonitor"]
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        kubernetes_validate.validate(one("PrometheusRule", "crossover"), KUBERNETES_VERSIONS[-1], strict=True)
    pytest.skip(
        "the Prometheus operator's CRD schemas (ServiceMonitor, PrometheusRule) are not available offline; "
        "their contents are checked by the tests below instead (rules = deploy/prometheus, promtool, selectors)"
    )


def test_prometheus_rule_is_deploy_prometheus_rules():
    assert one("PrometheusRule", "crossover")["spec"]["groups"] == rule_groups(), (
        "deploy/k8s/monitoring.yaml's PrometheusRule must hold the groups of deploy/prometheus/rules.yml and "
        "alerts.yml, in that order: copy them over after editing those files"
    )


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian package `prometheus`) is not installed")
def test_prometheus_rule_passes_promtool(tmp_path):
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": one("PrometheusRule", "crossover")["spec"]["groups"]}))
    result = subprocess.run(
        ["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_service_monitors_select_services_and_their_ports():
    services = documents("Service")
    for monitor in documents("ServiceMonitor"):
        selector = monitor["spec"]["selector"]["matchLabels"]
        selected = [s for s in services if selector.items() <= s["metadata"].get("labels", {}).items()]
        assert selected, f"ServiceMonitor {monitor['metadata']['name']} selects no Service"
        for endpoint in monitor["spec"]["endpoints"]:
            for service in selected:
                assert endpoint["port"] in {port["name"] for port in service["spec"]["ports"]}


def test_gateway_runs_several_replicas_with_the_max_load_signal(tmp_path):
    deployment = one("Deployment", "crossover-gateway")
    assert deployment["spec"]["replicas"] >= 2
    path = tmp_path / "crossover.toml"
    path.write_text(one("ConfigMap", "crossover-gateway")["data"]["crossover.toml"])
    settings = load_settings(path)
    assert settings.load_signal == "max"
    assert settings.topology == "partitioned"
    services = {f"{s['metadata']['name']}" for s in documents("Service")}
    for backend in settings.pools.speculative.backends + settings.pools.plain.backends:
        assert backend.split("//")[1].split(":")[0].split(".")[1] in services, backend


def test_gateway_pods_probe_health_take_the_token_from_the_secret_and_are_covered():
    deployment = one("Deployment", "crossover-gateway")
    main = container(deployment)
    assert main["readinessProbe"]["httpGet"]["path"] == "/health"
    # /health is 503 while no backend is healthy: restarting the gateway would not help, so liveness asks elsewhere.
    assert main["livenessProbe"]["httpGet"]["path"] != "/health"
    (token,) = [env for env in main["env"] if env["name"] == "CROSSOVER_ADMIN_TOKEN"]
    assert token["valueFrom"]["secretKeyRef"]["name"] == one("Secret", "crossover-gateway")["metadata"]["name"]
    build_parser().parse_args(["serve", *main["args"]])
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    for selector in (
        one("PodDisruptionBudget", "crossover-gateway")["spec"]["selector"]["matchLabels"],
        one("Service", "crossover-gateway")["spec"]["selector"],
    ):
        assert selector.items() <= labels.items()


def _plan(profile: str) -> list[dict]:
    result = subprocess.run(
        [*crossover_argv(), "servers", "plan", profile, "--json"],
        capture_output=True,
        text=True,
        timeout=PLAN_TIMEOUT_S,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_partitioned_servers_run_the_profile_commands_on_their_gpus():
    for server in _plan("llama8b-partitioned"):
        statefulset = one("StatefulSet", f"sglang-{server['name']}")
        pod = statefulset["spec"]["template"]["spec"]
        main = container(statefulset)
        expected = list(server["argv"])
        expected[expected.index("--host") + 1] = "0.0.0.0"
        expected[expected.index("--port") + 1] = "30000"
        assert main["command"] + main["args"] == expected
        gpus = len(server["env"]["CUDA_VISIBLE_DEVICES"].split(","))
        assert main["resources"]["limits"]["nvidia.com/gpu"] == gpus
        env = {item["name"]: item.get("value") for item in main["env"]}
        assert {k: v for k, v in server["env"].items() if k != "CUDA_VISIBLE_DEVICES"}.items() <= env.items()
        assert pod["nodeSelector"]
        _check_gpu_volumes(statefulset)


def _check_gpu_volumes(workload: dict) -> None:
    volumes = {volume["name"]: volume for volume in workload["spec"]["template"]["spec"]["volumes"]}
    mounts = {mount["mountPath"]: mount["name"] for mount in container(workload)["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    assert "persistentVolumeClaim" in volumes[mounts["/models"]]
    assert {"name": "HF_HOME", "value": "/models"} in container(workload)["env"]


def test_time_shared_pod_runs_the_agent_on_all_eight_gpus_with_the_shipped_profile(tmp_path):
    statefulset = one("StatefulSet", "sglang-time-shared")
    main = container(statefulset)
    assert main["resources"]["limits"]["nvidia.com/gpu"] == 8
    build_parser().parse_args(["servers", "agent", *main["args"]])
    _check_gpu_volumes(statefulset)

    # The profile in the ConfigMap is the shipped one, listening on the pod's interfaces.
    ((filename, text),) = one("ConfigMap", "crossover-profile-time-shared")["data"].items()
    (tmp_path / filename).write_text(text)
    mounted = load_profile(tmp_path / filename).model_dump()
    shipped = load_profile("kimi-k25-time-shared").model_dump()
    assert {server["host"] for server in mounted["servers"]} == {"0.0.0.0"}
    for server in mounted["servers"] + shipped["servers"]:
        server.pop("host")
    assert mounted == shipped
    assert main["args"][0].endswith("/" + filename)


def test_time_shared_gateway_config_loads_and_points_at_the_agent_pod(tmp_path, monkeypatch):
    monkeypatch.setenv("CROSSOVER_AGENT_TOKEN", "from-the-secret")
    path = tmp_path / "crossover.toml"
    path.write_text(one("ConfigMap", "crossover-gateway-time-shared")["data"]["crossover.toml"])
    settings = load_settings(path)
    assert settings.topology == "time-shared"
    ports = {port["name"]: port["port"] for port in one("Service", "sglang-time-shared")["spec"]["ports"]}
    assert settings.switching.agent_url == f"http://sglang-time-shared:{ports['agent']}"
    for mode in ("speculative", "plain"):
        assert getattr(settings.pools, mode).backends == [f"http://sglang-time-shared:{ports[mode]}"]
