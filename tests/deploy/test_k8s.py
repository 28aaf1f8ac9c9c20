"""deploy/k8s: every manifest validates against the Kubernetes schemas (kubernetes-validate, offline), and the
pieces agree with each other and with the rest of the project: the gateway's settings load, commands parse
with crossover's CLI, SGLang commands are the profiles', the PrometheusRule is deploy/prometheus's rules.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import tomllib

import pytest
import yaml

from crossover.gateway.cli import build_parser
from crossover.gateway.config import Settings, load_settings
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


TOPOLOGIES = ("partitioned", "time-shared", "in-engine")
CONFIG_DIR = "/etc/crossover/"


def gateway_settings(topology: str, tmp_path, monkeypatch) -> Settings:
    """The gateway ConfigMap's file for `topology`, loaded with the gateway's own loader, as a pod would: the
    in-engine engines' admin key read from where the pod mounts its Secret (here a file of the test's)."""
    for name, value in _secret_env(container(one("Deployment", "crossover-gateway"))).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("CROSSOVER_AGENT_TOKEN", "from-the-secret")
    key = tmp_path / "sglang-admin.key"
    key.write_text("engine-admin-key\n")
    text = one("ConfigMap", "crossover-gateway")["data"][f"{topology}.toml"]
    mounted = _secret_mount("sglang-admin") + "/key"
    path = tmp_path / f"{topology}.toml"
    path.write_text(text.replace(mounted, str(key)))
    return load_settings(path)


def _secret_env(main: dict) -> dict[str, str]:
    """The container's variables that come from a Secret of these files, as its placeholder values."""
    env = {}
    for item in main.get("env", []):
        ref = item.get("valueFrom", {}).get("secretKeyRef")
        if ref is not None and documents("Secret", ref["name"]):
            env[item["name"]] = one("Secret", ref["name"])["stringData"][ref["key"]]
    return env


def _secret_mount(secret: str) -> str:
    pod = one("Deployment", "crossover-gateway")["spec"]["template"]["spec"]
    (volume,) = [v["name"] for v in pod["volumes"] if v.get("secret", {}).get("secretName") == secret]
    (mount,) = [
        m["mountPath"] for m in container(one("Deployment", "crossover-gateway"))["volumeMounts"] if m["name"] == volume
    ]
    return mount


def test_the_gateway_config_holds_one_file_per_topology_and_the_pods_run_one_of_them():
    assert set(one("ConfigMap", "crossover-gateway")["data"]) == {f"{t}.toml" for t in TOPOLOGIES}
    args = container(one("Deployment", "crossover-gateway"))["args"]
    assert args[0] == "--config" and args[1].removeprefix(CONFIG_DIR) in one("ConfigMap", "crossover-gateway")["data"]
    mounts = {m["mountPath"]: m["name"] for m in container(one("Deployment", "crossover-gateway"))["volumeMounts"]}
    assert mounts[CONFIG_DIR.rstrip("/")] == "config"


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_every_topology_runs_three_replicas_sharing_one_redis(topology, tmp_path, monkeypatch):
    assert one("Deployment", "crossover-gateway")["spec"]["replicas"] == 3
    settings = gateway_settings(topology, tmp_path, monkeypatch)
    assert settings.topology == topology
    # The Redis every replica shares: the Service of the Redis Deployment in this file.
    redis = one("Service", "crossover-redis")
    (port,) = redis["spec"]["ports"]
    password = one("Secret", "crossover-cluster")["stringData"]["redis-password"]
    assert settings.cluster.redis_url == f"redis://:{password}@{redis['metadata']['name']}:{port['port']}/0"
    assert settings.cluster.key == one("Secret", "crossover-cluster")["stringData"]["key"]
    assert (
        redis["spec"]["selector"].items()
        <= one("Deployment", "crossover-redis")["spec"]["template"]["metadata"]["labels"].items()
    )
    assert settings.load_signal == ("local" if topology == "in-engine" else "max")


def test_each_topology_names_its_own_cluster():
    data = one("ConfigMap", "crossover-gateway")["data"]
    names = [tomllib.loads(data[f"{topology}.toml"])["cluster"]["name"] for topology in TOPOLOGIES]
    assert len(set(names)) == len(names)


def test_partitioned_backends_are_the_statefulsets_services(tmp_path, monkeypatch):
    settings = gateway_settings("partitioned", tmp_path, monkeypatch)
    services = {f"{s['metadata']['name']}" for s in documents("Service")}
    for backend in settings.pools.speculative.backends + settings.pools.plain.backends:
        assert backend.split("//")[1].split(":")[0].split(".")[1] in services, backend


def test_in_engine_sends_the_engines_admin_key_from_its_secret(tmp_path, monkeypatch):
    settings = gateway_settings("in-engine", tmp_path, monkeypatch)
    assert settings.pools.speculative.admin_api_key == "engine-admin-key" and settings.pools.plain is None
    pod = one("Deployment", "crossover-gateway")["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v.get("secret", {}).get("secretName") == "sglang-admin"]
    # Optional: the other topologies run without it. Readable by the gateway's group only.
    assert volume["secret"]["optional"] is True and volume["secret"]["defaultMode"] == 0o440
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"]


def test_redis_asks_for_the_password_the_gateways_connect_with():
    redis = container(one("Deployment", "crossover-redis"))
    args = redis["args"]
    assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    secret = _refs(redis)
    assert secret["REDIS_PASSWORD"] == secret["REDISCLI_AUTH"] == ("crossover-cluster", "redis-password")
    gateway = _refs(container(one("Deployment", "crossover-gateway")))
    assert gateway["CROSSOVER_CLUSTER__REDIS_URL"] == ("crossover-cluster", "redis-url")
    assert gateway["CROSSOVER_CLUSTER__KEY"] == ("crossover-cluster", "key")


def _refs(main: dict) -> dict[str, tuple[str, str]]:
    return {
        item["name"]: (ref["name"], ref["key"])
        for item in main.get("env", [])
        if (ref := item.get("valueFrom", {}).get("secretKeyRef")) is not None
    }


def test_redis_is_reachable_from_the_gateways_only():
    (policy,) = documents("NetworkPolicy")
    redis_labels = one("Deployment", "crossover-redis")["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= redis_labels.items()
    (rule,) = policy["spec"]["ingress"]
    (source,) = rule["from"]
    gateway_labels = one("Deployment", "crossover-gateway")["spec"]["template"]["metadata"]["labels"]
    assert source["podSelector"]["matchLabels"].items() <= gateway_labels.items()
    # Not scraped as a gateway: the gateway's ServiceMonitor selects on the gateway's name label.
    assert one("Service", "crossover-redis")["metadata"]["labels"]["app.kubernetes.io/name"] != "crossover-gateway"


def test_gateway_pods_run_workers_on_the_cores_they_request(tmp_path, monkeypatch):
    main = container(one("Deployment", "crossover-gateway"))
    env = {item["name"]: item for item in main["env"]}
    workers = int(env["CROSSOVER_WORKERS"]["value"])
    assert workers >= 2 and float(main["resources"]["requests"]["cpu"]) >= workers
    monkeypatch.setenv("CROSSOVER_WORKERS", str(workers))
    assert gateway_settings("partitioned", tmp_path, monkeypatch).workers == workers
    agent_token = env["CROSSOVER_AGENT_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert agent_token["name"] == one("Secret", "crossover-agent")["metadata"]["name"] and agent_token["optional"]


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
    settings = gateway_settings("time-shared", tmp_path, monkeypatch)
    assert settings.switching.agent_token == "from-the-secret"
    ports = {port["name"]: port["port"] for port in one("Service", "sglang-time-shared")["spec"]["ports"]}
    assert settings.switching.agent_url == f"http://sglang-time-shared:{ports['agent']}"
    for mode in ("speculative", "plain"):
        assert getattr(settings.pools, mode).backends == [f"http://sglang-time-shared:{ports[mode]}"]
