"""The chart's value sets against a real API server (server-side dry runs: nothing is
scheduled): the cpu and sim sets are admitted with helm 4's server-side apply and with the
client-side apply of helm 3, and a cluster without what the GPU set needs (the Prometheus CRDs,
its StorageClass, RuntimeClass "nvidia", nodes with GPUs) gets a failure or a NOTES warning that
names it, never pods that wait or crash silently."""

from __future__ import annotations

import uuid

import pytest
from kubernetes import client

from tests.cluster import kube

pytestmark = pytest.mark.e2e

GPU = ["-f", str(kube.CHART / "ci" / "gpu-pvc-values.yaml")]
NO_CRDS = ["--set", "metrics.serviceMonitor.enabled=false,metrics.prometheusRule.enabled=false"]


@pytest.fixture(scope="module")
def namespace(k8s):
    core = k8s[0]
    name = f"dry-run-{uuid.uuid4().hex[:6]}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    yield name
    core.delete_namespace(name)


def dry_run(helm, namespace: str, *values: str) -> str:
    return helm("install", "skiff", str(kube.CHART), "-n", namespace, *values, "--dry-run=server")


def failure(helm, namespace: str, *values: str) -> str:
    with pytest.raises(AssertionError) as failed:
        dry_run(helm, namespace, *values)
    return str(failed.value)


@pytest.mark.parametrize("profile", ["cpu", "sim"])
@pytest.mark.parametrize("server_side", ["true", "false"])
def test_the_cpu_and_sim_sets_are_admitted(helm, namespace, profile, server_side):
    values = ["-f", str(kube.CHART / "ci" / f"{profile}-values.yaml")]
    out = dry_run(helm, namespace, *values, f"--server-side={server_side}")
    assert "STATUS: pending-install" in out


def test_missing_crds_are_named(helm, namespace):
    message = failure(helm, namespace, *GPU)
    assert "monitoring.coreos.com/v1/ServiceMonitor" in message
    assert "monitoring.coreos.com/v1/PrometheusRule" in message


def test_a_missing_storage_class_is_named(helm, namespace):
    message = failure(helm, namespace, *GPU, *NO_CRDS)
    assert 'StorageClass "efs-sc" does not exist' in message


def test_a_missing_runtime_class_is_named(helm, namespace):
    message = failure(helm, namespace, *GPU, *NO_CRDS, "--set", "model.pvc.storageClass=")
    assert 'RuntimeClass "nvidia" does not exist' in message


def test_no_gpu_nodes_is_a_notes_warning(helm, namespace):
    fixed = ["--set", "model.pvc.storageClass=,worker.runtimeClassName="]
    out = dry_run(helm, namespace, *GPU, *NO_CRDS, *fixed)
    assert "no node of this cluster has allocatable nvidia.com/gpu" in out
