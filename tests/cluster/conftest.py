"""The real-cluster suite: the chart's cpu value set installed on a real Kubernetes.

Without KUBECONFIG the suite brings up its own cluster on this machine (tests/cluster/localkube:
Kubernetes v1.20.2 built from Debian's source, the real kubelet on containerd, the project's
images built offline from docker/*.Dockerfile) and stops it at the end; it needs root, and never
skips. With KUBECONFIG it uses that cluster, whose nodes must be able to pull the images:
SKIFF_TEST_VALUES names values files (separated by `:`) that say where (global.imageRegistry,
tags), as in docs/deployment.md.

The cluster lives as long as this package's tests (package-scoped fixtures), so the rest of
the suite runs without it. Every test shares one release (two CPU workers, two scheduler
replicas) in a namespace of its own; the gateway is reached through its Service (the local
cluster routes ClusterIPs from this host with kube-proxy) or, on another cluster, through a
port-forward to a gateway pod.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from kubernetes import client, config

from tests.cluster import kube
from tests.deploy.test_chart_render import find_helm

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "skiff"
LOCAL_VALUES = Path(__file__).with_name("local-values.yaml")
RELEASE = "skiff"
READY_TIMEOUT_S = 900  # image pulls and model conversion on a fresh node


@dataclass
class Cluster:
    kubeconfig: Path
    values: list[str]  # helm arguments: -f files and --set values
    local: object | None = None  # the LocalCluster this suite started, if any
    api: client.ApiClient = field(init=False)

    def __post_init__(self) -> None:
        self.api = config.new_client_from_config(str(self.kubeconfig))


@pytest.fixture(scope="package")
def cluster() -> Iterator[Cluster]:
    if os.environ.get("KUBECONFIG"):
        files = [f for f in os.environ.get("SKIFF_TEST_VALUES", "").split(os.pathsep) if f]
        yield Cluster(Path(os.environ["KUBECONFIG"]), [a for f in files for a in ("-f", f)])
        return
    assert os.geteuid() == 0, "the local cluster needs root (network namespaces, containerd)"
    from tests.cluster.localkube import cluster as localkube
    from tests.cluster.localkube import images

    archives = images.build_images()
    sets = [f"--set={key}={value}" for key, value in images.chart_values().items()]
    with localkube.running(list(archives.values())) as local:
        yield Cluster(local.kubeconfig, ["-f", str(LOCAL_VALUES), *sets], local)


@pytest.fixture(scope="package")
def k8s(cluster: Cluster):
    api = cluster.api
    return client.CoreV1Api(api), client.AppsV1Api(api), client.CoordinationV1Api(api), client


@pytest.fixture(scope="package")
def helm(cluster: Cluster):
    helm_bin = find_helm()
    assert helm_bin, "no helm binary: `make install` puts one at .venv/bin/helm"
    return lambda *args: kube.helm(helm_bin, f"--kubeconfig={cluster.kubeconfig}", *args)


@pytest.fixture(scope="package")
def release(cluster: Cluster, k8s, helm) -> Iterator[tuple[str, str]]:
    """The cpu profile installed in a fresh namespace; (namespace, release). Uninstalled (if a
    test has not) and the namespace deleted afterwards."""
    core, apps, _, _ = k8s
    namespace = f"skiff-test-{uuid.uuid4().hex[:6]}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace)))
    values = ["-f", str(CHART / "ci" / "cpu-values.yaml"), *cluster.values]
    values += ["--set", "worker.replicas=2", "--set", "scheduler.replicas=2"]
    try:
        try:
            helm(
                "install", RELEASE, str(CHART), "-n", namespace, *values, "--wait", "--timeout=15m"
            )
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{kube.describe_failures(core, namespace)}") from None
        assert kube.workloads_ready(apps, namespace, RELEASE)
        yield namespace, RELEASE
    finally:
        with contextlib.suppress(AssertionError):  # already uninstalled by the test of it
            helm("uninstall", RELEASE, "-n", namespace, "--wait")
        core.delete_namespace(namespace)


@pytest.fixture
def openai_client(cluster: Cluster, k8s, release):
    """An `openai` client of the gateway: through its Service on the local cluster, else
    through a port-forward to a ready gateway pod."""
    import openai

    core = k8s[0]
    namespace, name = release
    if cluster.local is not None:
        (service,) = kube.services(core, namespace, name, "gateway")
        port = service.spec.ports[0].port
        url = f"http://{service.spec.cluster_ip}:{port}/v1"
        yield openai.OpenAI(base_url=url, api_key="none", timeout=120)
        return
    (pod, *_) = kube.ready_pods(core, namespace, name, "gateway")
    with kube.port_forward(core, namespace, pod.metadata.name, 8000) as port:
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=120)
