"""The chart on every Kubernetes from 1.20 (Chart.yaml's kubeVersion) to the newest, rendered by a
real helm with `--kube-version` and no `--api-versions` beyond the CRDs (as helm does for a
client-only render) or with the new API versions declared (as a current cluster does): the API
versions of PodDisruptionBudgets and the HPA, no field the server's API lacks, `protocol` on
every port (helm 4's server-side apply on 1.20 refuses ports without it), the failures when an
enabled feature's CRD is not served, and the scheduling values of every pod.

kubernetes-validate has no schemas before 1.25, so the 1.20 render is checked field by field;
the render for the oldest version it has is validated in full.
"""

from __future__ import annotations

import functools
import json
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import kubernetes_validate.utils  # type: ignore[import-untyped]
import pytest
import yaml  # type: ignore[import-untyped]

from tests.deploy.test_chart_render import (
    CASE_IDS,
    CASES,
    CRD_API_VERSIONS,
    CRD_KINDS,
    HELM,
    MULTI_GPU,
    component,
    find,
    helm,
    pod_spec,
    validate_all,
    workloads,
)
from tests.deploy.test_deploy import CHART

Doc = dict[str, Any]
OLDEST = "1.20.2"
NEWEST = "1.33.0"
# What a current cluster declares (a client-only render does not know them).
CURRENT_APIS = "policy/v1/PodDisruptionBudget,autoscaling/v2/HorizontalPodAutoscaler"
CPU = CHART / "ci" / "cpu-values.yaml"
SIM = CHART / "ci" / "sim-values.yaml"
GPU_PVC = CHART / "ci" / "gpu-pvc-values.yaml"


def template_args(
    kube_version: str, api_versions: str, case: Path | None, overrides: Sequence[str]
) -> list[str]:
    args = ["template", "skiff", "--namespace", "llm", "--kube-version", kube_version]
    if api_versions:
        args += ["--api-versions", api_versions]
    if case is not None:
        args += ["-f", str(case)]
    for override in overrides:
        args += ["--set-json", override]
    return args


@functools.cache
def render_for(
    kube_version: str, case: Path | None, *overrides: str, api_versions: str = CRD_API_VERSIONS
) -> tuple[Doc, ...]:
    out = helm(*template_args(kube_version, api_versions, case, overrides))
    return tuple(d for d in yaml.safe_load_all(out) if d)


def render_error(case: Path | None, *overrides: str, api_versions: str = "") -> str:
    """helm template's error for a render that must fail."""
    helm("show", "chart")  # skips without helm, or fails under CI
    assert HELM is not None
    args = template_args(NEWEST, api_versions, case, overrides)
    done = subprocess.run(
        [HELM, *args, str(CHART)], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode != 0, f"rendered: {args}"
    return done.stderr


def kinds(docs: Iterable[Doc], kind: str) -> list[Doc]:
    return [d for d in docs if d["kind"] == kind]


def containers(doc: Doc) -> list[Doc]:
    pod = pod_spec(doc)
    return [*pod["containers"], *pod.get("initContainers", [])]


# ---- API versions and fields ------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_the_oldest_kubernetes_gets_its_own_api_versions_and_fields(case: Path | None) -> None:
    docs = render_for(OLDEST, case)
    assert kinds(docs, "PodDisruptionBudget")
    for pdb in kinds(docs, "PodDisruptionBudget"):
        assert pdb["apiVersion"] == "policy/v1beta1", pdb["metadata"]["name"]
    for hpa in kinds(docs, "HorizontalPodAutoscaler"):
        assert hpa["apiVersion"] == "autoscaling/v2beta2"
    for sts in kinds(docs, "StatefulSet"):
        assert "rollingUpdate" not in sts["spec"].get("updateStrategy", {}), sts["metadata"]
        # StatefulSet fields of 1.22 and later
        assert not {"minReadySeconds", "persistentVolumeClaimRetentionPolicy"} & set(sts["spec"])
    for doc in workloads(docs):
        pod = pod_spec(doc)
        assert "os" not in pod and "hostUsers" not in pod
        for volume in pod.get("volumes", []):
            assert "ephemeral" not in volume, (doc["metadata"]["name"], volume)
        for c in containers(doc):
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                assert set(c.get(probe, {})) & {"grpc", "terminationGracePeriodSeconds"} == set()
    for policy in kinds(docs, "NetworkPolicy"):
        for rule in policy["spec"]["ingress"]:
            assert all("endPort" not in port for port in rule["ports"])


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_a_current_kubernetes_gets_the_new_api_versions(case: Path | None) -> None:
    docs = render_for(NEWEST, case, api_versions=f"{CRD_API_VERSIONS},{CURRENT_APIS}")
    for pdb in kinds(docs, "PodDisruptionBudget"):
        assert pdb["apiVersion"] == "policy/v1", pdb["metadata"]["name"]
    for hpa in kinds(docs, "HorizontalPodAutoscaler"):
        assert hpa["apiVersion"] == "autoscaling/v2"
    worker = find(docs, "StatefulSet", "skiff-worker")
    assert worker["spec"]["updateStrategy"]["rollingUpdate"] == {"maxUnavailable": 1}


def test_declared_api_versions_win_over_the_kube_version() -> None:
    """A 1.22 cluster serves policy/v1 (1.21) but not autoscaling/v2 (1.23)."""
    docs = render_for(
        "1.22.0", MULTI_GPU, api_versions=f"{CRD_API_VERSIONS},policy/v1/PodDisruptionBudget"
    )
    assert {p["apiVersion"] for p in kinds(docs, "PodDisruptionBudget")} == {"policy/v1"}
    (hpa,) = kinds(docs, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2beta2"


def test_topology_spread_fields_newer_than_the_server_are_left_out() -> None:
    spread = {
        "maxSkew": 1,
        "topologyKey": "kubernetes.io/hostname",
        "whenUnsatisfiable": "DoNotSchedule",
        "minDomains": 2,
        "nodeAffinityPolicy": "Honor",
        "nodeTaintsPolicy": "Ignore",
        "matchLabelKeys": ["pod-template-hash"],
    }
    values = json.dumps({"gateway": {"topologySpreadConstraints": [spread]}})
    expected = {
        OLDEST: {"maxSkew", "topologyKey", "whenUnsatisfiable"},
        "1.24.0": {"maxSkew", "topologyKey", "whenUnsatisfiable", "minDomains"},
        NEWEST: set(spread),
    }
    for version, fields in expected.items():
        gateway = find(render_for(version, None, values), "Deployment", "skiff-gateway")
        (constraint,) = pod_spec(gateway)["topologySpreadConstraints"]
        assert set(constraint) == fields, version
        assert constraint.items() <= spread.items()


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_every_port_names_its_protocol(case: Path | None) -> None:
    """Server-side apply on 1.20 refuses a port list whose entries omit `protocol`, a key of
    the list."""
    docs = render_for(OLDEST, case)
    ports = 0
    for service in kinds(docs, "Service"):
        for port in service["spec"]["ports"]:
            assert port.get("protocol") == "TCP", (service["metadata"]["name"], port)
            ports += 1
    for doc in workloads(docs):
        for c in containers(doc):
            for port in c.get("ports", []):
                assert port.get("protocol") == "TCP", (doc["metadata"]["name"], c["name"], port)
                ports += 1
    assert ports >= 6  # gpu-pvc: no bundled NATS, one port per Service and container


def test_the_render_for_the_oldest_validatable_kubernetes_is_valid() -> None:
    """kubernetes-validate's oldest schemas (1.25; none for 1.20 to 1.24): the render for that
    version, every built-in object strict."""
    versions = kubernetes_validate.utils.all_versions()
    oldest = min(versions, key=lambda v: tuple(int(p) for p in v.split(".")))
    assert "1.20.0" not in versions and oldest == "1.25.0"
    checked = sum(validate_all(render_for(oldest, case), oldest) for case in CASES)
    assert checked >= 40


# ---- prerequisites ----------------------------------------------------------------------------

FEATURES = {
    "ServiceMonitor": ('{"metrics":{"serviceMonitor":{"enabled":true}}}', "metrics.serviceMonitor"),
    "PrometheusRule": ('{"metrics":{"prometheusRule":{"enabled":true}}}', "metrics.prometheusRule"),
    "ScaledObject": (
        '{"worker":{"autoscaling":{"enabled":true,"serverAddress":"http://prometheus:9090"}}}',
        "worker.autoscaling",
    ),
    "HTTPRoute": (
        '{"gateway":{"httpRoute":{"enabled":true,"parentRefs":[{"name":"public"}]}}}',
        "gateway.httpRoute",
    ),
}


@pytest.mark.parametrize("kind", FEATURES)
def test_a_feature_whose_crd_is_not_served_fails_the_render(kind: str) -> None:
    override, value = FEATURES[kind]
    api = f"{CRD_KINDS[kind]}/{kind}"
    error = render_error(None, override)
    assert f"{value}.enabled needs the {kind} " in error and f"({api})" in error, error
    assert f"set {value}.enabled=false" in error
    # served: it renders
    docs = kinds(render_for(NEWEST, None, override, api_versions=api), kind)
    assert docs and {d["apiVersion"] for d in docs} == {CRD_KINDS[kind]}


def test_every_missing_crd_is_named_at_once() -> None:
    error = render_error(MULTI_GPU)
    for kind in ("ServiceMonitor", "ScaledObject", "HTTPRoute"):
        assert f"{kind} " in error, error
    assert "PrometheusRule" not in error  # not enabled there
    error = render_error(GPU_PVC, api_versions="monitoring.coreos.com/v1/ServiceMonitor")
    assert "PrometheusRule" in error and "ServiceMonitor " not in error


def test_an_older_gateway_api_gets_its_httproute_version() -> None:
    override, _ = FEATURES["HTTPRoute"]
    docs = render_for(
        NEWEST, None, override, api_versions="gateway.networking.k8s.io/v1beta1/HTTPRoute"
    )
    (route,) = kinds(docs, "HTTPRoute")
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1beta1"


def test_the_lint_knows_no_cluster_and_checks_no_crd() -> None:
    lint = helm("lint", "--strict", "-f", str(MULTI_GPU), "--kube-version", OLDEST)
    assert "0 chart(s) failed" in lint


def test_the_bundled_nats_pdb_has_a_switch() -> None:
    on = render_for(NEWEST, MULTI_GPU)
    assert find(on, "PodDisruptionBudget", "skiff-nats")["spec"]["maxUnavailable"] == 1
    off = render_for(NEWEST, MULTI_GPU, '{"nats":{"pdb":{"enabled":false}}}')
    names = {d["metadata"]["name"] for d in kinds(off, "PodDisruptionBudget")}
    assert names == {"skiff-gateway", "skiff-worker"}


# ---- scheduling -------------------------------------------------------------------------------

TAINT = {"key": "skiff.test/local-node", "operator": "Equal", "value": "true"}
TOLERATION = {**TAINT, "effect": "NoSchedule"}
NODE = {"kubernetes.io/hostname": "localhost"}


@pytest.mark.parametrize("case", [CPU, SIM], ids=["cpu", "sim"])
def test_every_pod_takes_pull_policy_tolerations_and_node_selector(case: Path | None) -> None:
    """What a test cluster of one tainted node needs, for every pod and init container."""
    pod = {"image": {"pullPolicy": "Never"}, "tolerations": [TOLERATION], "nodeSelector": NODE}
    overrides = [json.dumps({c: pod}) for c in ("gateway", "scheduler", "worker", "nats")]
    docs = render_for(OLDEST, case, *overrides)
    seen = set()
    for doc in workloads(docs):
        spec = pod_spec(doc)
        seen.add(component(doc))
        assert spec["nodeSelector"] == NODE, doc["metadata"]["name"]
        assert spec["tolerations"] == [TOLERATION], doc["metadata"]["name"]
        for c in containers(doc):
            assert c["imagePullPolicy"] == "Never", (doc["metadata"]["name"], c["name"])
    assert seen == {"gateway", "scheduler", "worker", "nats"}
    init = {c["name"] for d in workloads(docs) for c in pod_spec(d).get("initContainers", [])}
    assert "nats-config" in init


def test_simulated_workers_drop_only_the_gpu_toleration() -> None:
    worker = pod_spec(find(render_for(NEWEST, SIM), "StatefulSet", "skiff-worker"))
    assert "tolerations" not in worker  # the default one is nvidia.com/gpu's
    gpu = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    override = json.dumps({"worker": {"tolerations": [gpu, TOLERATION]}})
    worker = pod_spec(find(render_for(NEWEST, SIM, override), "StatefulSet", "skiff-worker"))
    assert worker["tolerations"] == [TOLERATION]


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_every_resource_quantity_is_a_string(case: Path | None) -> None:
    """Server-side apply on 1.20 refuses a number where the schema has a Quantity (the
    worker's nvidia.com/gpu: 1 and a user's cpu: 2 alike)."""
    docs = render_for(OLDEST, case, '{"gateway":{"resources":{"limits":{"cpu":2}}}}')
    quantities = 0
    for doc in workloads(docs):
        for c in containers(doc):
            for section in c["resources"].values():
                for name, quantity in section.items():
                    assert isinstance(quantity, str), (doc["metadata"]["name"], c["name"], name)
                    quantities += 1
    assert quantities >= 6
    gateway = find(docs, "Deployment", "skiff-gateway")
    assert pod_spec(gateway)["containers"][0]["resources"]["limits"]["cpu"] == "2"
