"""The chart's lower KV tiers, KV-transfer path and shard routing, rendered by a real helm:
worker.kvOffloading, worker.kvTransfer and gateway.shardRouting reach the services' SKIFF_*
environment and parse to the settings they name, the defaults are the services' own (the
transfer port aside), the disk tier gets its volume, a memory limit too small for the host tier
fails the render, and the NetworkPolicies open the KV-transfer port to this release's workers
and nothing else."""

from __future__ import annotations

import dataclasses
import json
import subprocess
from collections.abc import Iterable
from typing import Any

import pytest

from services.gateway.config import GatewayConfig
from services.gateway.main import build_parser as gateway_parser
from services.worker.config import RunnerConfig, SimConfig, WorkerServiceConfig
from services.worker.main import build_parser as worker_parser
from tests.deploy.test_chart_render import (
    CRD_API_VERSIONS,
    HELM,
    KUBERNETES_VERSIONS,
    MULTI_GPU,
    find,
    helm,
    pod_spec,
    render,
    selects,
    validate_all,
    workloads,
)
from tests.deploy.test_deploy import CHART, VALUES, env_vars_read_by, merged, validator

CPU = CHART / "ci" / "cpu-values.yaml"
SIM = CHART / "ci" / "sim-values.yaml"
GPU_PVC = CHART / "ci" / "gpu-pvc-values.yaml"
WORKER = ("StatefulSet", "skiff-worker")
NVME: Doc = {"hostPath": {"path": "/mnt/nvme/skiff-kv", "type": "Directory"}}
Doc = dict[str, Any]
EPHEMERAL: Doc = {
    "ephemeral": {
        "volumeClaimTemplate": {
            "spec": {
                "accessModes": ["ReadWriteOnce"],
                "storageClassName": "local-nvme",
                "resources": {"requests": {"storage": "120Gi"}},
            }
        }
    }
}
TIERS: Doc = {"hostGiB": 4, "diskGiB": 100, "diskPath": "/kv", "diskVolume": NVME}


def worker_overrides(worker: Doc) -> str:
    return f"worker={json.dumps(worker)}"


def container(docs: Iterable[Doc], kind: str, name: str) -> Doc:
    containers: list[Doc] = pod_spec(find(docs, kind, name))["containers"]
    (c,) = containers
    return c


def env_of(c: Doc) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}


def worker_settings(env: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The tier and transfer settings `skiff worker` parses from `env`."""
    for name, value in env.items():
        if name.startswith("SKIFF_") and isinstance(value, str):
            monkeypatch.setenv(name, value)
    parser = worker_parser()
    ns, configs = parser.parse_configs([])
    runner = parser.config(RunnerConfig, ns, model_dir="/models/m")
    service = configs[WorkerServiceConfig]
    return {
        "kv_offloading_size": runner.kv_offloading_size,
        "kv_offloading_disk_size": runner.kv_offloading_disk_size,
        "kv_offloading_disk_path": runner.kv_offloading_disk_path,
        "kv_transfer_host": service.kv_transfer_host,
        "kv_transfer_port": service.kv_transfer_port,
    }


def gateway_settings(env: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> tuple[str, float]:
    for name, value in env.items():
        if name.startswith("SKIFF_") and isinstance(value, str):
            monkeypatch.setenv(name, value)
    config = gateway_parser().parse_configs([])[1][GatewayConfig]
    return config.shard_routing, config.shard_routing_max_imbalance


def volumes(pod: Doc) -> dict[str, Doc]:
    return {v["name"]: v for v in pod["volumes"]}


# ---- the worker -------------------------------------------------------------------------------


def test_the_tier_values_reach_the_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    docs = render(None, worker_overrides({"kvOffloading": TIERS, "kvTransfer": {"port": 7100}}))
    c = container(docs, "StatefulSet", "skiff-worker")
    env = env_of(c)
    assert env["SKIFF_KV_TRANSFER_ADVERTISE_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert worker_settings(env, monkeypatch) == {
        "kv_offloading_size": 4.0,
        "kv_offloading_disk_size": 100.0,
        "kv_offloading_disk_path": "/kv",
        "kv_transfer_host": "0.0.0.0",
        "kv_transfer_port": 7100,
    }
    ports = {p["name"]: p for p in c["ports"]}
    assert ports["kv-transfer"] == {"name": "kv-transfer", "containerPort": 7100, "protocol": "TCP"}
    assert {"name": "kv-disk", "mountPath": "/kv"} in c["volumeMounts"]
    assert volumes(pod_spec(find(docs, "StatefulSet", "skiff-worker")))["kv-disk"] == {
        "name": "kv-disk",
        **NVME,
    }


def test_the_default_tiers_are_the_workers_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both tiers off and no disk volume; the transfer server listens on a fixed port (the
    worker's own default, 0, picks any free one, which no NetworkPolicy could name)."""
    docs = render(None)
    c = container(docs, "StatefulSet", "skiff-worker")
    defaults = {f.name: f.default for f in dataclasses.fields(RunnerConfig)}
    settings = worker_settings(env_of(c), monkeypatch)
    for name in ("kv_offloading_size", "kv_offloading_disk_size", "kv_offloading_disk_path"):
        assert settings[name] == defaults[name], name
    assert settings["kv_transfer_port"] == VALUES["worker"]["kvTransfer"]["port"] == 7071
    assert "SKIFF_KV_OFFLOADING_DISK_PATH" not in env_of(c)
    assert "kv-disk" not in volumes(pod_spec(find(docs, "StatefulSet", "skiff-worker")))


@pytest.mark.parametrize(("disk_gib", "size_limit"), [(0.25, "2Gi"), (100, "101Gi")])
def test_the_disk_tier_defaults_to_an_emptydir_that_holds_it(
    disk_gib: float, size_limit: str
) -> None:
    tiers = {"hostGiB": 1, "diskGiB": disk_gib}
    docs = render(None, worker_overrides({"kvOffloading": tiers}))
    worker = pod_spec(find(docs, "StatefulSet", "skiff-worker"))
    assert volumes(worker)["kv-disk"] == {"name": "kv-disk", "emptyDir": {"sizeLimit": size_limit}}
    (c,) = worker["containers"]
    path = VALUES["worker"]["kvOffloading"]["diskPath"]
    assert env_of(c)["SKIFF_KV_OFFLOADING_DISK_PATH"] == path
    assert {"name": "kv-disk", "mountPath": path} in c["volumeMounts"]


def test_the_cpu_ci_values_run_both_tiers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cluster tests install these values: a host tier inside the memory limit and a disk
    tier on the default emptyDir."""
    docs = render(CPU)
    worker = pod_spec(find(docs, "StatefulSet", "skiff-worker"))
    settings = worker_settings(env_of(worker["containers"][0]), monkeypatch)
    assert settings["kv_offloading_size"] > 0 and settings["kv_offloading_disk_size"] > 0
    assert "emptyDir" in volumes(worker)["kv-disk"]


def test_simulated_workers_get_tier_sizes_but_no_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    """Simulated tiers hold no data: the sizes reach the workers, no path or volume does."""
    worker = pod_spec(find(render(SIM), "StatefulSet", "skiff-worker"))
    env = env_of(worker["containers"][0])
    assert float(env["SKIFF_KV_OFFLOADING_DISK_SIZE"]) > 0
    assert "SKIFF_KV_OFFLOADING_DISK_PATH" not in env
    assert "kv-disk" not in volumes(worker)
    assert worker_settings(env, monkeypatch)["kv_offloading_disk_path"] == ""


@pytest.mark.parametrize("volume", [{}, NVME, EPHEMERAL], ids=["emptyDir", "hostPath", "ephemeral"])
def test_the_worker_with_tiers_is_valid_kubernetes(volume: Doc) -> None:
    tiers = {**TIERS, "diskVolume": volume}
    docs = render(None, worker_overrides({"kvOffloading": tiers}))
    worker = find(docs, "StatefulSet", "skiff-worker")
    assert validate_all([worker], KUBERNETES_VERSIONS[-1]) == 1


def render_error(*overrides: str) -> str:
    """helm template's error for a render that must fail."""
    helm("show", "chart")  # skips without helm, or fails under CI
    assert HELM is not None
    args = ["template", "skiff", "--api-versions", CRD_API_VERSIONS]
    for override in overrides:
        args += ["--set-json", override]
    done = subprocess.run(
        [HELM, *args, str(CHART)], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode != 0, f"rendered: {overrides}"
    return done.stderr


@pytest.mark.parametrize("limit", ["32Gi", "32768Mi", "34359738368", "30G"])
def test_a_memory_limit_that_cannot_hold_the_host_tier_fails(limit: str) -> None:
    too_big = {"kvOffloading": {"hostGiB": 32}, "resources": {"limits": {"memory": limit}}}
    assert "worker.kvOffloading.hostGiB (32)" in render_error(worker_overrides(too_big))
    fits = {"kvOffloading": {"hostGiB": 16}, "resources": {"limits": {"memory": limit}}}
    assert render(None, worker_overrides(fits))


def test_the_transfer_port_must_not_be_the_metrics_port() -> None:
    assert "must differ" in render_error(worker_overrides({"kvTransfer": {"port": 9090}}))


# SKIFF_* variables of `skiff worker` the chart does not set, and why.
WORKER_NOT_IN_CHART = {
    "SKIFF_NUM_BLOCKS": "sized from worker.kvCacheGiB (simulated workers: an H200's)",
    "SKIFF_BLOCK_SIZE": "the services' default (16 tokens), as the gateways hash prompts",
    "SKIFF_CUDA_GRAPHS": "always on in a deployment (extraEnv turns them off to debug)",
    "SKIFF_FUSED_CPU_DECODE": "the CPU worker's default (extraEnv turns it off)",
    "SKIFF_CPU_WEIGHTS": "exact fp32 by default; the other formats change outputs (extraEnv)",
    "SKIFF_HEARTBEAT_INTERVAL": "a protocol timing, kept at the services' default",
    "SKIFF_NATS_TLS_CERT": "the chart's NATS TLS verifies the server; clients use passwords",
    "SKIFF_NATS_TLS_KEY": "the chart's NATS TLS verifies the server; clients use passwords",
    "SKIFF_ROLES": "a pod's simulated workers share its set's role (SKIFF_ROLE)",
}


def test_every_worker_setting_is_a_chart_value_or_left_out_on_purpose() -> None:
    """A new worker setting (a tier's, say) fails here until the chart sets it or says why
    not."""
    read = env_vars_read_by("worker")
    optional = [
        'nats={"tls": {"enabled": true, "secretName": "nats-tls"}}',
        'otlpTracesEndpoint="http://otel-collector:4318"',
        'worker.kvOffloading={"hostGiB": 1, "diskGiB": 1}',  # over the case's own values
        'lora={"enabled": true, "volume": {"emptyDir": {}}}',
    ]
    set_by_chart: set[str] = set()
    for case in (CPU, SIM, GPU_PVC):
        for overrides in ((), optional):
            set_by_chart |= set(env_of(container(render(case, *overrides), *WORKER)))
    callout = (  # a service-account token instead of a password (nats.authCallout)
        'nats={"authCallout": {"enabled": true, "signingKeySecret": "k"}}',
        *(
            f'{role}={{"serviceAccount": {{"create": true}}}}'
            for role in ("gateway", "scheduler", "worker")
        ),
    )
    set_by_chart |= set(env_of(container(render(CPU, *callout), *WORKER)))
    assert not set(WORKER_NOT_IN_CHART) & set_by_chart, "set by the chart: drop it"
    assert set(WORKER_NOT_IN_CHART) <= read, "not a worker setting: drop it"
    missing = read - set_by_chart - set(WORKER_NOT_IN_CHART)
    assert not missing, f"`skiff worker` settings the chart cannot set: {sorted(missing)}"


def test_simulated_kv_loads_take_the_sim_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    docs = render(SIM, "worker.sim.kvLoadGbps=12.5")
    for name, value in env_of(container(docs, *WORKER)).items():
        if name.startswith("SKIFF_") and isinstance(value, str):
            monkeypatch.setenv(name, value)
    configs = worker_parser().parse_configs([])[1]
    assert configs[SimConfig].sim_kv_load_gbps == 12.5
    default = {f.name: f.default for f in dataclasses.fields(SimConfig)}["sim_kv_load_gbps"]
    assert VALUES["worker"]["sim"]["kvLoadGbps"] == default


# ---- NetworkPolicy ----------------------------------------------------------------------------


def policy_rules(docs: Iterable[Doc]) -> dict[str, list[Doc]]:
    return {
        d["metadata"]["name"]: d["spec"]["ingress"] for d in docs if d["kind"] == "NetworkPolicy"
    }


def test_only_this_releases_workers_reach_the_kv_transfer_port() -> None:
    docs = render(MULTI_GPU)
    pods = {d["metadata"]["name"]: d["spec"]["template"] for d in workloads(docs)}
    rules = policy_rules(docs)
    transfer = [
        (name, rule)
        for name, ingress in rules.items()
        for rule in ingress
        if {"port": "kv-transfer", "protocol": "TCP"} in rule["ports"]
    ]
    ((policy, rule),) = transfer
    assert policy == "skiff-worker"
    assert rule["ports"] == [{"port": "kv-transfer", "protocol": "TCP"}]
    (peer,) = rule["from"]
    assert set(peer) == {"podSelector"}  # this namespace only
    allowed = {n for n, t in pods.items() if selects(peer["podSelector"], t["metadata"]["labels"])}
    assert allowed == {"skiff-worker"}
    # the rest is as before: metricsFrom on the metrics ports, nothing else
    np = merged(VALUES, {"networkPolicy": {"enabled": True}})["networkPolicy"]
    metrics_only = [{"from": np["metricsFrom"], "ports": [{"port": "metrics", "protocol": "TCP"}]}]
    assert rules["skiff-scheduler"] == metrics_only
    assert [r for r in rules["skiff-worker"] if r is not rule] == metrics_only


def test_without_metrics_peers_the_workers_still_take_each_other() -> None:
    docs = render(MULTI_GPU, 'networkPolicy={"enabled": true, "metricsFrom": []}')
    rules = policy_rules(docs)
    assert rules["skiff-scheduler"] == []
    ((port,),) = [r["ports"] for r in rules["skiff-worker"]]
    assert port == {"port": "kv-transfer", "protocol": "TCP"}


# ---- the gateway ------------------------------------------------------------------------------


def test_shard_routing_reaches_the_gateway(monkeypatch: pytest.MonkeyPatch) -> None:
    docs = render(None, 'gateway={"shardRouting": {"mode": "load", "maxImbalance": 2.5}}')
    env = env_of(container(docs, "Deployment", "skiff-gateway"))
    assert env["SKIFF_SHARD_ROUTING"] == "load"
    assert gateway_settings(env, monkeypatch) == ("load", 2.5)


def test_the_default_shard_routing_is_the_gateways_default(monkeypatch: pytest.MonkeyPatch) -> None:
    env = env_of(container(render(None), "Deployment", "skiff-gateway"))
    defaults = {f.name: f.default for f in dataclasses.fields(GatewayConfig)}
    expected = (defaults["shard_routing"], defaults["shard_routing_max_imbalance"])
    assert gateway_settings(env, monkeypatch) == expected == ("prefix", 4.0)


# ---- schema -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override",
    [
        {"worker": {"kvOffloading": {"hostGiB": 0, "diskGiB": 10}}},  # disk needs the host tier
        {"worker": {"kvOffloading": {"hostGiB": -1}}},
        {"worker": {"kvOffloading": {"diskPath": "relative/kv"}}},
        {"worker": {"kvOffloading": {"hostGiB": 1, "ssdGiB": 1}}},
        {"worker": {"kvTransfer": {"port": 0}}},
        {"worker": {"kvTransfer": {"port": 70000}}},
        {"gateway": {"shardRouting": {"mode": "random"}}},
        {"gateway": {"shardRouting": {"maxImbalance": -1}}},
    ],
)
def test_the_schema_refuses_settings_the_services_refuse(override: Doc) -> None:
    assert list(validator().iter_errors(merged(VALUES, override)))


def test_the_schema_takes_the_documented_examples() -> None:
    volume: Doc
    for volume in (NVME, EPHEMERAL):
        tiers: Doc = {"hostGiB": 64, "diskGiB": 512, "diskVolume": volume}
        values = merged(VALUES, {"worker": {"kvOffloading": tiers}})
        assert not list(validator().iter_errors(values))
