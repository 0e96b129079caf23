"""The chart rendered by a real helm (.venv/bin/helm from `make install`, else helm on PATH) for
every values set in charts/skiff/ci plus the defaults: `helm lint --strict`, every object valid
for Kubernetes 1.30 and 1.33 (`kubernetes-validate --strict`), probes on real routes, stable pod
template labels, autoscalers, NetworkPolicies, per-service NATS credentials, the API key Secret
and the escape hatches. Without helm these tests skip, except under CI, where they fail.
"""

from __future__ import annotations

import base64
import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import kubernetes_validate.utils
import pytest
import yaml

from tests.deploy.test_deploy import (
    CHART,
    ROOT,
    SERVICES,
    VALUES,
    VALUES_CASES,
    env_vars_read_by,
    load_yaml,
    merged,
    project_modules,
)

CASES = [None, *VALUES_CASES]
CASE_IDS = [p.name if p else "default" for p in CASES]
MULTI_GPU = CHART / "ci" / "multi-gpu-values.yaml"
KUBERNETES_VERSIONS = ("1.30.0", "1.33.0")
# Custom resources: kubernetes-validate has schemas for built-in kinds only.
CRD_KINDS = {
    "ScaledObject": "keda.sh/v1alpha1",
    "ServiceMonitor": "monitoring.coreos.com/v1",
    "PrometheusRule": "monitoring.coreos.com/v1",
    "HTTPRoute": "gateway.networking.k8s.io/v1",
}
# What `helm template` is told the cluster serves: the CRDs of the features the values enable
# (the chart fails without them).
CRD_API_VERSIONS = ",".join(f"{api}/{kind}" for kind, api in CRD_KINDS.items())
RELEASE = "skiff"


def find_helm() -> str | None:
    beside = Path(sys.executable).parent / "helm"
    return str(beside) if beside.is_file() else shutil.which("helm")


HELM = find_helm()


def helm(*args: str, chart: Path = CHART) -> str:
    if HELM is None:
        reason = "no helm binary: `make install` puts one at .venv/bin/helm"
        if os.environ.get("CI"):
            pytest.fail(f"CI must render the chart: {reason}")
        pytest.skip(reason)
    cmd = [HELM, *args, str(chart)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr + done.stdout
    return done.stdout


def values_args(case: Path | None, overrides: tuple[str, ...]) -> list[str]:
    args = [] if case is None else ["-f", str(case)]
    for override in overrides:
        args += ["--set-json", override]
    return args


@functools.cache
def render(
    case: Path | None, *overrides: str, release: str = RELEASE, chart: Path = CHART
) -> tuple[dict, ...]:
    """The objects `helm template` renders; `overrides` are --set-json arguments."""
    out = helm(
        "template",
        release,
        "--namespace",
        "llm",
        "--api-versions",
        CRD_API_VERSIONS,
        *values_args(case, overrides),
        chart=chart,
    )
    return tuple(d for d in yaml.safe_load_all(out) if d)


def values_of(case: Path | None) -> dict:
    return VALUES if case is None else merged(VALUES, load_yaml(case))


def find(docs, kind: str, name: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def workloads(docs) -> list[dict]:
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]


def component(doc: dict) -> str:
    return doc["metadata"]["labels"]["app.kubernetes.io/component"]


def pod_spec(doc: dict) -> dict:
    return doc["spec"]["template"]["spec"]


# ---- lint, render, validate -------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_helm_lint_and_template(case):
    lint = helm("lint", "--strict", *values_args(case, ()))
    assert "0 chart(s) failed" in lint
    docs = render(case)
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert ("StatefulSet", "skiff-worker") in kinds and ("Deployment", "skiff-gateway") in kinds
    values = values_of(case)
    read = {s: env_vars_read_by(s) for s in SERVICES}
    for doc in docs:
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "skiff"
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        pod = pod_spec(doc)
        assert pod["securityContext"]["runAsNonRoot"] is True
        extra = {e["name"] for e in values.get(component(doc), {}).get("extraEnv", [])}
        for c in pod["containers"] + pod.get("initContainers", []):
            assert c["securityContext"]["readOnlyRootFilesystem"] is True
            env = {e["name"] for e in c.get("env", []) if e["name"].startswith("SKIFF_")}
            assert env - extra <= read.get(c["name"], set()), (c["name"], env)
    worker = find(docs, "StatefulSet", "skiff-worker")
    limits = pod_spec(worker)["containers"][0]["resources"].get("limits", {})
    assert ("nvidia.com/gpu" in limits) == (values["worker"]["device"] == "cuda")


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_every_object_is_valid_kubernetes(case, version):
    assert version in kubernetes_validate.utils.all_versions()
    assert validate_all(render(case), version) >= 8


def validate_all(docs, version: str) -> int:
    """Validates every built-in object of `docs` strictly at `version` (custom resources must
    have their CRD's apiVersion); how many were validated."""
    checked = 0
    for doc in docs:
        if doc["kind"] in CRD_KINDS:
            assert doc["apiVersion"] == CRD_KINDS[doc["kind"]], doc["metadata"]["name"]
            continue
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{doc['kind']} {doc['metadata']['name']} ({version}): {e.message}")
        checked += 1
    return checked


def test_validation_catches_a_bad_object():
    """kubernetes-validate --strict refuses what the API server would (the check is live)."""
    deployment = find(render(None), "Deployment", "skiff-gateway")
    broken = yaml.safe_load(yaml.safe_dump(deployment))
    pod_spec(broken)["containers"][0]["readinessProbe"]["httpGet"]["pathh"] = "/health"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[0], strict=True)


# ---- probes -----------------------------------------------------------------------------------


class _ReadyEngine:
    ready = True
    max_model_len = 2048

    class stats:
        submitted = rejected = aborted = migrated = failed = 0


class _OneTokenTokenizer:
    vocab_size = 1
    chat_template = None

    def token_bytes(self, i: int) -> bytes:
        return b"a"


def route_status(service: str, path: str) -> int:
    """The status of GET `path` on the service's own HTTP app (404: no such route)."""
    if service == "gateway":
        from starlette.testclient import TestClient

        from services.gateway.app import create_app
        from services.gateway.config import GatewayConfig

        app = create_app(_ReadyEngine(), _OneTokenTokenizer(), GatewayConfig(max_model_len=2048))
        return TestClient(app).get(path).status_code
    probes = ROOT / "shared" / "http_probes.py"
    assert probes in project_modules(f"services.{service}.main"), f"{service} serves no probes"
    from prometheus_client import CollectorRegistry

    from shared.http_probes import ProbeServer

    server = ProbeServer(CollectorRegistry(), live=lambda: None, ready=lambda: None)
    status: list[str] = []
    env = {"PATH_INFO": path, "REQUEST_METHOD": "GET", "wsgi.url_scheme": "http"}
    b"".join(server.app(env, lambda s, headers, *exc: status.append(s)))
    return int(status[0].split()[0])


def test_a_worker_has_20_minutes_to_load_and_is_seen_loaded_within_2_s():
    """A rolling upgrade waits for each new worker to be ready; its readiness is probed only
    once the startup probe passed."""
    (worker,) = [d for d in workloads(render(None)) if component(d) == "worker"]
    probe = pod_spec(worker)["containers"][0]["startupProbe"]
    assert probe["periodSeconds"] <= 2 and probe["timeoutSeconds"] <= probe["periodSeconds"]
    assert probe["periodSeconds"] * probe["failureThreshold"] >= 20 * 60


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_services_have_probes_on_real_routes(case):
    required = {
        "gateway": ("readinessProbe", "livenessProbe"),
        "scheduler": ("readinessProbe", "livenessProbe"),
        "worker": ("startupProbe", "readinessProbe", "livenessProbe"),
    }
    seen = set()
    for doc in workloads(render(case)):
        service = component(doc)
        if service not in required:
            continue
        for c in pod_spec(doc)["containers"]:
            seen.add(service)
            ports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
            listens = {e.get("value") for e in c.get("env", []) if e["name"].endswith("PORT")}
            for kind in required[service]:
                assert kind in c, f"{doc['metadata']['name']}/{c['name']}: no {kind}"
                get = c[kind]["httpGet"]
                port = ports.get(get["port"], get["port"])
                assert str(port) in listens, f"{c['name']} {kind}: port {get['port']}"
                assert route_status(service, get["path"]) not in (404, 405), (
                    f"{c['name']} {kind}: {get['path']} is no route of the {service}"
                )
    assert seen == set(required)


# ---- upgrades ---------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_pod_template_labels_are_stable(case):
    for doc in workloads(render(case)):
        labels = doc["spec"]["template"]["metadata"]["labels"]
        assert doc["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert not {"helm.sh/chart", "app.kubernetes.io/version"} & set(labels), doc["metadata"]


def test_a_chart_only_upgrade_rolls_no_pod(tmp_path):
    """A new chart version with the same appVersion renders the same pod templates."""
    bumped = tmp_path / "skiff"
    shutil.copytree(CHART, bumped)
    meta = load_yaml(bumped / "Chart.yaml")
    meta["version"] = meta["version"] + "-next"
    (bumped / "Chart.yaml").write_text(yaml.safe_dump(meta))
    for case in (None, MULTI_GPU):
        before = {d["metadata"]["name"]: d["spec"]["template"] for d in workloads(render(case))}
        after = {
            d["metadata"]["name"]: d["spec"]["template"]
            for d in workloads(render(case, chart=bumped))
        }
        assert before == after


# ---- autoscaling, NATS, NetworkPolicy, API key ------------------------------------------------


def test_autoscalers_own_the_replica_counts():
    docs = render(MULTI_GPU)
    values = values_of(MULTI_GPU)
    gateway = find(docs, "Deployment", "skiff-gateway")
    worker = find(docs, "StatefulSet", "skiff-worker")
    assert "replicas" not in gateway["spec"] and "replicas" not in worker["spec"]
    hpa = find(docs, "HorizontalPodAutoscaler", "skiff-gateway")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "skiff-gateway",
    }
    scaled = find(docs, "ScaledObject", "skiff-worker")
    assert scaled["spec"]["scaleTargetRef"]["name"] == "skiff-worker"
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    assert trigger["metadata"]["query"] == (
        'sum(vllm:num_requests_waiting{namespace="llm",model_name="Qwen3-8B"})'
    )
    assert trigger["metadata"]["threshold"] == "8"
    # every pod KEDA may start has a NATS user
    most = values["worker"]["autoscaling"]["maxReplicas"]
    (items,) = [
        v["secret"]["items"] for v in pod_spec(worker)["volumes"] if v["name"] == "nats-auth"
    ]
    assert [i["key"] for i in items] == [f"skiff-worker-{i}" for i in range(most)]
    defaults = render(None)
    assert "replicas" in find(defaults, "StatefulSet", "skiff-worker")["spec"]
    assert not {"HorizontalPodAutoscaler", "ScaledObject"} & {d["kind"] for d in defaults}


def test_nats_auth_gives_each_service_only_its_own_credentials():
    docs = render(MULTI_GPU)
    workers = [f"skiff-worker-{i}" for i in range(16)]
    own = {"gateway": ["gateway"], "scheduler": ["scheduler"], "worker": workers}
    for doc in workloads(docs):
        pod = pod_spec(doc)
        secrets = {v["name"]: v["secret"] for v in pod.get("volumes", []) if "secret" in v}
        if component(doc) == "nats":
            assert "items" not in secrets["auth"]  # the server knows every user
            continue
        keys = [i["key"] for i in secrets["nats-auth"]["items"]]
        assert keys == own[component(doc)], doc["metadata"]["name"]
        (c,) = pod["containers"]
        env = {e["name"]: e.get("value") for e in c["env"]}
        user = "$(SKIFF_WORKER_ID)" if component(doc) == "worker" else component(doc)
        assert env["SKIFF_NATS_USER"] == user
        assert env["SKIFF_NATS_PASSWORD_FILE"] == f"/etc/skiff/nats-auth/{user}"


def test_nats_cluster():
    docs = render(MULTI_GPU)
    nats = find(docs, "StatefulSet", "skiff-nats")
    assert nats["spec"]["replicas"] == 3
    assert nats["spec"]["serviceName"] == "skiff-nats-cluster"
    find(docs, "Service", "skiff-nats-cluster")
    (init,) = pod_spec(nats)["initContainers"]  # the routes are in its nats.conf
    routes = [a.split("=", 1)[1] for a in init["command"] if a.startswith("--cluster-route=")]
    assert routes == [f"nats://skiff-nats-{i}.skiff-nats-cluster.llm.svc:6222" for i in range(3)]
    assert find(docs, "PodDisruptionBudget", "skiff-nats")["spec"]["maxUnavailable"] == 1
    single = find(render(None), "StatefulSet", "skiff-nats")
    assert single["spec"]["replicas"] == 1
    (init,) = pod_spec(single)["initContainers"]
    assert not any(a.startswith("--cluster") for a in init["command"])


def selects(selector: dict, labels: dict) -> bool:
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] in ("In", "DoesNotExist")
        if expr["operator"] == "DoesNotExist":
            if expr["key"] in labels:
                return False
        elif labels.get(expr["key"]) not in expr["values"]:
            return False
    return True


def test_network_policies():
    docs = render(MULTI_GPU)
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    pods = {d["metadata"]["name"]: d["spec"]["template"] for d in workloads(docs)}
    covered = set()
    for policy in policies:
        spec = policy["spec"]
        assert spec["policyTypes"] == ["Ingress"]
        targets = [
            n for n, t in pods.items() if selects(spec["podSelector"], t["metadata"]["labels"])
        ]
        assert targets, policy["metadata"]["name"]
        covered |= set(targets)
        for name in targets:
            named = {
                p["name"] for c in pods[name]["spec"]["containers"] for p in c.get("ports", [])
            }
            for rule in spec["ingress"]:
                for port in rule["ports"]:
                    assert port["port"] in named, (policy["metadata"]["name"], name, port)
    assert covered == set(pods)
    # NATS clients: this release's gateways, schedulers and workers, nothing else
    nats = find(docs, "NetworkPolicy", "skiff-nats")["spec"]["ingress"]
    (clients,) = [r for r in nats if r["ports"] == [{"port": "client", "protocol": "TCP"}]]
    (peer,) = clients["from"]
    allowed = {n for n, t in pods.items() if selects(peer["podSelector"], t["metadata"]["labels"])}
    assert allowed == {"skiff-gateway", "skiff-scheduler", "skiff-worker"}
    assert set(peer) == {"podSelector"}  # this namespace only
    # the gateway's HTTP port: the ingress controller and Prometheus
    (http,) = find(docs, "NetworkPolicy", "skiff-gateway")["spec"]["ingress"]
    np = values_of(MULTI_GPU)["networkPolicy"]
    assert http["from"] == np["ingressFrom"] + np["metricsFrom"]
    assert not [d for d in render(None) if d["kind"] == "NetworkPolicy"]


def api_key_env(docs) -> dict | None:
    (c,) = pod_spec(find(docs, "Deployment", "skiff-gateway"))["containers"]
    return next((e for e in c["env"] if e["name"] == "SKIFF_API_KEY"), None)


def test_api_key_from_a_created_or_an_existing_secret():
    docs = render(MULTI_GPU)
    secret = find(docs, "Secret", "skiff-api-key")
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    key = base64.b64decode(secret["data"]["api-key"]).decode()
    assert len(key) == 48 and key.isalnum()
    ref = api_key_env(docs)["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "skiff-api-key", "key": "api-key"}
    assert "SKIFF_API_KEY" in env_vars_read_by("gateway")

    existing = render(None, '{"gateway":{"apiKeySecret":{"name":"vault-llm","key":"token"}}}')
    assert api_key_env(existing)["valueFrom"]["secretKeyRef"] == {
        "name": "vault-llm",
        "key": "token",
    }
    assert not [d for d in existing if d["kind"] == "Secret" and "api" in d["metadata"]["name"]]
    assert api_key_env(render(None)) is None


# ---- escape hatches ---------------------------------------------------------------------------


def test_escape_hatches_reach_the_objects():
    docs = render(MULTI_GPU)
    values = values_of(MULTI_GPU)
    g = values["gateway"]
    gateway = find(docs, "Deployment", "skiff-gateway")
    meta, pod = gateway["spec"]["template"]["metadata"], pod_spec(gateway)
    assert meta["annotations"] == g["podAnnotations"]
    assert g["podLabels"].items() <= meta["labels"].items()
    (c,) = pod["containers"]
    assert c["envFrom"] == g["envFrom"]
    assert c["env"][-len(g["extraEnv"]) :] == g["extraEnv"]
    assert c["volumeMounts"][-1] == g["extraVolumeMounts"][0]
    assert pod["volumes"][-1] == g["extraVolumes"][0]
    assert pod["topologySpreadConstraints"] == g["topologySpreadConstraints"]
    service = find(docs, "Service", "skiff-gateway")
    assert service["metadata"]["annotations"] == g["service"]["annotations"]

    worker = pod_spec(find(docs, "StatefulSet", "skiff-worker"))
    assert worker["priorityClassName"] == "gpu-serving"
    assert worker["serviceAccountName"] == "skiff-worker"
    account = find(docs, "ServiceAccount", "skiff-worker")
    assert account["metadata"]["annotations"] == values["worker"]["serviceAccount"]["annotations"]
    scheduler = pod_spec(find(docs, "Deployment", "skiff-scheduler"))
    assert scheduler["priorityClassName"] == "system-cluster-critical"

    ingress = find(docs, "Ingress", "skiff-gateway")["spec"]
    (rule,) = ingress["rules"]
    assert rule["host"] == "llm.example.com"
    backend = rule["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": "skiff-gateway", "port": {"name": "http"}}
    route = find(docs, "HTTPRoute", "skiff-gateway")["spec"]
    assert route["parentRefs"] == g["httpRoute"]["parentRefs"]
    assert route["rules"][0]["backendRefs"] == [{"name": "skiff-gateway", "port": 8000}]

    off = {d["kind"] for d in render(None)}
    assert not {"Ingress", "HTTPRoute", "ServiceAccount"} & off


def test_dashboard_uid_is_unique_per_release():
    on = '{"grafana":{"dashboards":{"enabled":true}}}'
    boards = []
    for release in ("a", "b"):
        (cm,) = [d for d in render(None, on, release=release) if d["kind"] == "ConfigMap"]
        boards.append(yaml.safe_load(cm["data"]["skiff.json"]))
    uids = {b["uid"] for b in boards}
    assert len(uids) == 2 and all(len(u) <= 40 for u in uids)
    assert boards[0]["title"] == "skiff (llm/a)"
