"""The real-cluster suite: runs when KUBECONFIG names a reachable cluster, skips otherwise.

It installs the chart's cpu profile (charts/skiff/ci/cpu-values.yaml, two workers and two
scheduler replicas) into a namespace of its own with the helm of `make install`, waits for
readiness through the `kubernetes` client, and talks to a gateway through a port-forward. The
images must be pullable by the cluster: SKIFF_TEST_VALUES names a values file that says where
(global.imageRegistry, tags), as in docs/deployment.md.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from tests.cluster import kube
from tests.deploy.test_chart_render import find_helm

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "skiff"
RELEASE = "skiff"
READY_TIMEOUT_S = 900  # image pulls and model conversion on a fresh node


def _cluster_or_skip():
    if not os.environ.get("KUBECONFIG"):
        pytest.skip("no cluster: KUBECONFIG is not set")
    from kubernetes import client, config

    try:
        config.load_kube_config()
        client.VersionApi().get_code(_request_timeout=10)
    except Exception as e:  # any failure to reach it: no cluster for this run
        pytest.skip(f"no cluster: KUBECONFIG {os.environ['KUBECONFIG']} unreachable ({e})")
    return client


@pytest.fixture(scope="session")
def k8s():
    client = _cluster_or_skip()
    return client.CoreV1Api(), client.AppsV1Api(), client.CoordinationV1Api(), client


@pytest.fixture(scope="session")
def release(k8s):
    """The cpu profile installed in a fresh namespace; (namespace, release). Uninstalled and the
    namespace deleted afterwards."""
    core, apps, _, client = k8s
    helm_bin = find_helm()
    assert helm_bin, "no helm binary: `make install` puts one at .venv/bin/helm"
    namespace = f"skiff-test-{uuid.uuid4().hex[:6]}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace)))
    values = ["-f", str(CHART / "ci" / "cpu-values.yaml")]
    if os.environ.get("SKIFF_TEST_VALUES"):
        values += ["-f", os.environ["SKIFF_TEST_VALUES"]]
    values += ["--set", "worker.replicas=2", "--set", "scheduler.replicas=2"]
    try:
        kube.helm(helm_bin, "install", RELEASE, str(CHART), "-n", namespace, *values)
        kube.wait_until(
            "every workload ready",
            lambda: kube.workloads_ready(apps, namespace, RELEASE),
            READY_TIMEOUT_S,
            every_s=5,
        )
        yield namespace, RELEASE
    finally:
        kube.helm(helm_bin, "uninstall", RELEASE, "-n", namespace, "--wait")
        core.delete_namespace(namespace)


@pytest.fixture
def openai_client(k8s, release):
    """An `openai` client for a ready gateway pod, through a port-forward."""
    import openai

    core = k8s[0]
    namespace, name = release
    (pod, *_) = kube.ready_pods(core, namespace, name, "gateway")
    with kube.port_forward(core, namespace, pod.metadata.name, 8000) as port:
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=120)
