"""The chart's prefill/decode disaggregation, rendered by a real helm: worker.prefill and
worker.decode each add a StatefulSet of workers of that role (pods <release>-skiff-worker-<role>-N,
whose trailing ordinal picks the shard) with its own Service, PDB, NetworkPolicy, ServiceMonitor,
NATS users and KEDA ScaledObject (prefill: the prompts waiting for a prefill worker; decode: the
decode workers' mean KV cache usage, on metrics the services export), the scheduler gets
scheduler.disaggregationThreshold, and the default install renders no role set."""

from __future__ import annotations

import base64
import dataclasses
import json
from collections.abc import Callable, Iterable
from typing import Any

import pytest

from services.scheduler.main import build_parser as scheduler_parser
from services.worker.config import WorkerServiceConfig
from services.worker.main import build_parser as worker_parser
from services.worker.metrics import WorkerMetrics
from shared.config import SchedulerConfig
from shared.subjects import worker_shard
from tests.deploy.test_chart_kube_versions import render_error
from tests.deploy.test_chart_render import (
    KUBERNETES_VERSIONS,
    find,
    pod_spec,
    render,
    selects,
    validate_all,
    workloads,
)
from tests.deploy.test_deploy import (
    CHART,
    VALUES,
    exported_metrics,
    load_yaml,
    merged,
    promql_names,
    validator,
)

Doc = dict[str, Any]
PD = CHART / "ci" / "pd-values.yaml"
SIM = CHART / "ci" / "sim-values.yaml"
PROMETHEUS = "http://prometheus:9090"
# Both role sets on their own GPU nodes, decode with its own KV cache; no mixed workers.
BOTH: Doc = {
    "replicas": 0,
    "autoscaling": {"serverAddress": PROMETHEUS},
    "prefill": {"enabled": True, "replicas": 3, "nodeSelector": {"pool": "prefill"}},
    "decode": {
        "enabled": True,
        "replicas": 2,
        "kvCacheGiB": 60,
        "resources": {"requests": {"cpu": "4", "memory": "64Gi"}, "limits": {"memory": "96Gi"}},
        "nodeSelector": {"pool": "decode"},
    },
}
SETS = {"worker": "mixed", "worker-prefill": "prefill", "worker-decode": "decode"}


def worker_values(worker: Doc) -> tuple[str, ...]:
    """--set-json overrides of each worker.<key> (one of worker alone would replace the worker
    values of a case's file)."""
    return tuple(f"worker.{key}={json.dumps(value)}" for key, value in worker.items())


def with_autoscaling(**sets: Doc) -> tuple[str, ...]:
    """BOTH, with KEDA on for the named sets (autoscaling values of each)."""
    worker = json.loads(json.dumps(BOTH))
    for role, autoscaling in sets.items():
        worker[role]["autoscaling"] = {"enabled": True, **autoscaling}
    return worker_values(worker)


def container(doc: Doc) -> Doc:
    containers: list[Doc] = pod_spec(doc)["containers"]
    (c,) = containers
    return c


def env_of(doc: Doc) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container(doc)["env"]}


def parsed(
    build_parser: Callable[[], Any], env: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> dict[type, Any]:
    """The configs a service parses from the SKIFF_* variables of `env` (its parser reads the
    environment when built)."""
    with monkeypatch.context() as m:
        for name, value in env.items():
            if name.startswith("SKIFF_") and isinstance(value, str):
                m.setenv(name, value)
        configs: dict[type, Any] = build_parser().parse_configs([])[1]
    return configs


def statefulsets(docs: Iterable[Doc]) -> dict[str, Doc]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == "StatefulSet"}


def of_kind(docs: Iterable[Doc], kind: str) -> dict[str, Doc]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def nats_keys(doc: Doc) -> list[str]:
    (volume,) = [v for v in pod_spec(doc)["volumes"] if v["name"] == "nats-auth"]
    return [i["key"] for i in volume["secret"]["items"]]


# ---- the worker sets --------------------------------------------------------------------------


def test_the_default_install_renders_no_role_set(monkeypatch: pytest.MonkeyPatch) -> None:
    docs = render(None)
    labels = {d["metadata"]["labels"]["app.kubernetes.io/component"] for d in docs}
    assert not {"worker-prefill", "worker-decode"} & labels
    assert set(statefulsets(docs)) == {"skiff-nats", "skiff-worker"}
    worker = find(docs, "StatefulSet", "skiff-worker")
    # its workers are mixed, the worker's own default
    service = parsed(worker_parser, env_of(worker), monkeypatch)[WorkerServiceConfig]
    default = {f.name: f.default for f in dataclasses.fields(WorkerServiceConfig)}["role"]
    assert service.role == default == "mixed"


def test_each_role_set_is_a_statefulset_of_its_role(monkeypatch: pytest.MonkeyPatch) -> None:
    docs = render(None, *worker_values(BOTH))
    sets = statefulsets(docs)
    assert set(sets) == {"skiff-nats", *(f"skiff-{s}" for s in SETS)}
    for name, role in SETS.items():
        sts = sets[f"skiff-{name}"]
        assert sts["spec"]["serviceName"] == f"skiff-{name}"
        selector = sts["spec"]["selector"]["matchLabels"]
        assert selector["app.kubernetes.io/component"] == name
        # no StatefulSet selects another set's pods
        others = [d for n, d in sets.items() if n != sts["metadata"]["name"]]
        assert not [d for d in others if selects(sts["spec"]["selector"], pod_labels(d))]
        env = env_of(sts)
        assert env["SKIFF_ROLE"] == role
        assert env["SKIFF_WORKER_ID"] == {"fieldRef": {"fieldPath": "metadata.name"}}
        assert parsed(worker_parser, env, monkeypatch)[WorkerServiceConfig].role == role
        # the same image, device and KV-transfer port as every worker
        assert container(sts)["image"] == container(sets["skiff-worker"])["image"]
        assert env["SKIFF_DEVICE"] == env_of(sets["skiff-worker"])["SKIFF_DEVICE"] == "cuda"
        assert env["SKIFF_KV_TRANSFER_PORT"] == str(VALUES["worker"]["kvTransfer"]["port"])
    assert [sets[f"skiff-{n}"]["spec"]["replicas"] for n in SETS] == [0, 3, 2]


def pod_labels(doc: Doc) -> dict[str, str]:
    labels: dict[str, str] = doc["spec"]["template"]["metadata"]["labels"]
    return labels


def test_a_role_set_overrides_only_what_it_sets() -> None:
    """Empty values (kvCacheGiB 0, resources {}, ...) take worker's; set ones replace them."""
    docs = render(None, *worker_values(BOTH))
    mixed, prefill, decode = (find(docs, "StatefulSet", f"skiff-{n}") for n in SETS)
    assert env_of(prefill)["SKIFF_KV_CACHE_GIB"] == env_of(mixed)["SKIFF_KV_CACHE_GIB"] == "8"
    assert env_of(decode)["SKIFF_KV_CACHE_GIB"] == "60"
    assert container(prefill)["resources"] == container(mixed)["resources"]
    assert container(decode)["resources"] == {
        "requests": {"cpu": "4", "memory": "64Gi"},
        "limits": {"memory": "96Gi", "nvidia.com/gpu": "1"},
    }
    assert pod_spec(prefill)["nodeSelector"] == {"pool": "prefill"}
    assert pod_spec(decode)["nodeSelector"] == {"pool": "decode"}
    assert "nodeSelector" not in pod_spec(mixed)
    for doc in (prefill, decode):
        assert pod_spec(doc)["tolerations"] == pod_spec(mixed)["tolerations"]


def test_the_host_tier_check_names_the_sets_memory_limit() -> None:
    decode = {**BOTH["decode"], "resources": {"limits": {"memory": "8Gi"}}}
    overrides = {**BOTH, "kvOffloading": {"hostGiB": 16}, "decode": decode}
    error = render_error(None, *worker_values(overrides))
    assert "worker.kvOffloading.hostGiB (16) does not fit in worker.decode.resources" in error


def test_simulated_role_sets_take_the_sim_resources_and_no_gpu() -> None:
    docs = render(SIM, *worker_values(BOTH))
    mixed, prefill = (find(docs, "StatefulSet", f"skiff-{n}") for n in ("worker", "worker-prefill"))
    assert container(prefill)["resources"] == container(mixed)["resources"]
    assert "nvidia.com/gpu" not in container(prefill)["resources"].get("limits", {})
    assert not [t for t in pod_spec(prefill).get("tolerations", []) if "nvidia" in t["key"]]


def test_worker_ids_end_in_their_ordinal_so_every_shard_gets_each_role() -> None:
    """Shard selection reads the trailing number of the worker id: a set of 2 x shards pods
    puts 2 pods of its role on each shard."""
    docs = render(None, *worker_values(BOTH), 'scheduler={"shards": 2}')
    users = nats_keys(find(docs, "StatefulSet", "skiff-worker-prefill"))
    assert users == ["skiff-worker-prefill-0", "skiff-worker-prefill-1", "skiff-worker-prefill-2"]
    assert [worker_shard(u, 2) for u in users] == [0, 1, 0]


# ---- NATS -------------------------------------------------------------------------------------


def test_each_worker_pod_has_a_nats_user_and_mounts_only_its_sets() -> None:
    docs = render(
        None, *with_autoscaling(decode={"minReplicas": 1, "maxReplicas": 5, "threshold": 0.8})
    )
    expected = {
        "skiff-worker": [],  # replicas 0
        "skiff-worker-prefill": [f"skiff-worker-prefill-{i}" for i in range(3)],
        # every pod KEDA may start
        "skiff-worker-decode": [f"skiff-worker-decode-{i}" for i in range(5)],
    }
    sets = statefulsets(docs)
    for name, users in expected.items():
        volumes = {v["name"]: v for v in pod_spec(sets[name])["volumes"]}
        if users:
            assert nats_keys(sets[name]) == users, name
        else:  # a secret volume without items would hold every password
            assert volumes["nats-auth"] == {"name": "nats-auth", "emptyDir": {}}
        env = env_of(sets[name])
        assert env["SKIFF_NATS_USER"] == "$(SKIFF_WORKER_ID)"
        assert env["SKIFF_NATS_PASSWORD_FILE"] == "/etc/skiff/nats-auth/$(SKIFF_WORKER_ID)"
    every_worker = [u for users in expected.values() for u in users]
    secret = find(docs, "Secret", "skiff-nats-auth")["data"]
    assert set(secret) == {"admin", "gateway", "scheduler", *every_worker}
    assert len({base64.b64decode(p) for p in secret.values()}) == len(secret)
    # the bundled server knows each of them as a worker user
    (init,) = pod_spec(find(docs, "StatefulSet", "skiff-nats"))["initContainers"]
    assert [a.removeprefix("--worker=") for a in init["command"] if "--worker=" in a] == (
        every_worker
    )


def test_simulated_role_set_users_host_their_workers() -> None:
    """A simulated pod hosts sim.count workers (ids <pod name>-<j>) under its one NATS user."""
    docs = render(SIM, *worker_values(BOTH))
    (init,) = pod_spec(find(docs, "StatefulSet", "skiff-nats"))["initContainers"]
    workers = [a for a in init["command"] if a.startswith("--worker=skiff-worker-decode-")]
    count = load_yaml(SIM)["worker"]["sim"]["count"]
    assert count > 1
    ids = [",".join(f"skiff-worker-decode-{i}-{j}" for j in range(count)) for i in range(2)]
    assert workers == [f"--worker=skiff-worker-decode-{i}={ids[i]}" for i in range(2)]


# ---- Services, PDBs, NetworkPolicies, ServiceMonitors -----------------------------------------


def test_each_set_has_its_service_pdb_policy_and_service_monitor() -> None:
    docs = render(PD)
    pods = {n: pod_labels(d) for n, d in statefulsets(docs).items()}
    services, pdbs = of_kind(docs, "Service"), of_kind(docs, "PodDisruptionBudget")
    policies, monitors = of_kind(docs, "NetworkPolicy"), of_kind(docs, "ServiceMonitor")
    for name in (f"skiff-{s}" for s in SETS):
        service = services[name]["spec"]
        assert service["clusterIP"] == "None"
        chosen = [
            n for n, labels in pods.items() if selects({"matchLabels": service["selector"]}, labels)
        ]
        assert chosen == [name]
        assert [p["name"] for p in service["ports"]] == ["metrics"]
        pdb = pdbs[name]["spec"]
        assert [n for n, labels in pods.items() if selects(pdb["selector"], labels)] == [name]
        policy = policies[name]["spec"]
        assert [n for n, labels in pods.items() if selects(policy["podSelector"], labels)] == [name]
        monitor = monitors[name]["spec"]
        assert selects(monitor["selector"], services[name]["metadata"]["labels"])
    # the role sets' workers are scraped as the job of every worker, which the alerts name
    for name in ("skiff-worker-prefill", "skiff-worker-decode"):
        (endpoint,) = monitors[name]["spec"]["endpoints"]
        assert endpoint["relabelings"] == [
            {"action": "replace", "targetLabel": "job", "replacement": "skiff-worker"}
        ]
    assert "relabelings" not in monitors["skiff-worker"]["spec"]["endpoints"][0]


def test_every_worker_reaches_every_workers_kv_transfer_port_and_nats() -> None:
    docs = render(PD)
    workers = {n for n in statefulsets(docs) if n != "skiff-nats"}
    pods = {d["metadata"]["name"]: pod_labels(d) for d in workloads(docs)}
    for name in workers:
        ingress = find(docs, "NetworkPolicy", name)["spec"]["ingress"]
        (rule,) = [r for r in ingress if {"port": "kv-transfer", "protocol": "TCP"} in r["ports"]]
        assert all(set(peer) == {"podSelector"} for peer in rule["from"])  # this namespace only
        allowed = {
            n
            for n, labels in pods.items()
            if any(selects(peer["podSelector"], labels) for peer in rule["from"])
        }
        assert allowed == workers, name
    nats = find(docs, "NetworkPolicy", "skiff-nats")["spec"]["ingress"]
    (clients,) = [r for r in nats if r["ports"] == [{"port": "client", "protocol": "TCP"}]]
    (peer,) = clients["from"]
    allowed = {n for n, labels in pods.items() if selects(peer["podSelector"], labels)}
    assert allowed == {"skiff-gateway", "skiff-scheduler-0", "skiff-scheduler-1", *workers}


# ---- autoscaling ------------------------------------------------------------------------------


def trigger(docs: Iterable[Doc], name: str) -> Doc:
    scaled = find(docs, "ScaledObject", name)
    assert scaled["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "name": name,
    }
    (t,) = scaled["spec"]["triggers"]
    assert t["type"] == "prometheus"
    return dict(t)


def test_keda_scales_prefill_on_its_queue_and_decode_on_its_kv_usage() -> None:
    docs = render(
        None,
        *with_autoscaling(
            prefill={"minReplicas": 2, "maxReplicas": 6, "threshold": 3},
            decode={"minReplicas": 2, "maxReplicas": 4, "threshold": 0.7},
        ),
    )
    assert set(of_kind(docs, "ScaledObject")) == {"skiff-worker-prefill", "skiff-worker-decode"}
    prefill, decode = trigger(docs, "skiff-worker-prefill"), trigger(docs, "skiff-worker-decode")
    # waiting prompts / threshold pods
    assert "metricType" not in prefill
    assert prefill["metadata"] == {
        "serverAddress": PROMETHEUS,
        "query": 'sum(skiff_role_requests{namespace="llm",role="prefill",state="waiting"})',
        "threshold": "3",
    }
    # pods x mean usage / threshold: a utilization target
    assert decode["metricType"] == "Value"
    workers = 'namespace="llm",worker_id=~"skiff-worker-decode-.+"'
    assert decode["metadata"] == {
        "serverAddress": PROMETHEUS,
        "query": f'avg(sum by (worker_id) (skiff_worker_kv_cache_blocks{{{workers},state="used"}})'
        f" / sum by (worker_id) (skiff_worker_kv_cache_blocks{{{workers}}}))",
        "threshold": "0.7",
    }
    spec = find(docs, "ScaledObject", "skiff-worker-decode")["spec"]
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (2, 4)
    # KEDA owns the replicas of the scaled sets only
    sets = statefulsets(docs)
    assert "replicas" not in sets["skiff-worker-prefill"]["spec"]
    assert "replicas" not in sets["skiff-worker-decode"]["spec"]
    assert sets["skiff-worker"]["spec"]["replicas"] == 0


def test_the_default_queries_name_metrics_and_labels_the_services_export() -> None:
    docs = render(PD)
    exported = exported_metrics()  # the scheduler's and the gateway's
    for collector, names in WorkerMetrics("m").registry._collector_to_names.items():
        for metric in names:  # the workers' own
            exported[metric] = set(getattr(collector, "_labelnames", ()))
    for name in ("skiff-worker-prefill", "skiff-worker-decode"):
        query = trigger(docs, name)["metadata"]["query"]
        metrics, labels = promql_names(query)
        assert metrics and metrics <= set(exported), query
        # namespace is the scrape's target label
        available = {"namespace"}.union(*(exported[m] for m in metrics))
        assert labels <= available, query


def test_a_query_replaces_the_default_and_the_prometheus_is_workers() -> None:
    query = "max(skiff_role_requests)"
    docs = render(None, *with_autoscaling(prefill={"query": query}))
    assert trigger(docs, "skiff-worker-prefill")["metadata"]["query"] == query
    assert trigger(docs, "skiff-worker-prefill")["metadata"]["serverAddress"] == PROMETHEUS


def test_a_scaled_role_set_without_keda_fails_the_render() -> None:
    error = render_error(None, *with_autoscaling(prefill={}))
    assert "worker.prefill.autoscaling.enabled needs the ScaledObject (KEDA) CRD" in error
    assert "set worker.prefill.autoscaling.enabled=false" in error
    assert "worker.decode.autoscaling" not in error and " worker.autoscaling" not in error


# ---- the scheduler ----------------------------------------------------------------------------


def scheduler_config(docs: Iterable[Doc], monkeypatch: pytest.MonkeyPatch) -> SchedulerConfig:
    deployment = [d for d in workloads(docs) if d["metadata"]["name"].startswith("skiff-sched")]
    configs = parsed(scheduler_parser, env_of(deployment[0]), monkeypatch)
    config: SchedulerConfig = configs[SchedulerConfig]
    return config


def test_the_threshold_reaches_the_scheduler(monkeypatch: pytest.MonkeyPatch) -> None:
    docs = render(None, 'scheduler={"disaggregationThreshold": 2048}')
    assert scheduler_config(docs, monkeypatch).disaggregation_threshold == 2048
    default = {f.name: f.default for f in dataclasses.fields(SchedulerConfig)}
    assert VALUES["scheduler"]["disaggregationThreshold"] == default["disaggregation_threshold"]
    assert scheduler_config(render(None), monkeypatch).disaggregation_threshold == 512
    for deployment in workloads(render(PD)):
        if deployment["metadata"]["name"].startswith("skiff-scheduler"):
            assert env_of(deployment)["SKIFF_DISAGGREGATION_THRESHOLD"] == "1024"


# ---- valid objects and values -----------------------------------------------------------------


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_the_role_sets_are_valid_kubernetes(version: str) -> None:
    docs = render(None, *worker_values(BOTH), 'networkPolicy={"enabled": true}')
    assert validate_all(docs, version) >= 14


@pytest.mark.parametrize(
    "worker",
    [
        {"prefill": {"enabled": True, "gpus": 1}},
        {"decode": {"replicas": -1}},
        {"decode": {"kvCacheGiB": -1}},
        {"decode": {"autoscaling": {"threshold": 1.5}}},  # a usage: at most 1
        {"prefill": {"autoscaling": {"threshold": 0}}},
        {"prefill": {"autoscaling": {"serverAddress": PROMETHEUS}}},  # worker.autoscaling's
        {"prefill": {"role": "decode"}},
    ],
)
def test_the_schema_refuses_bad_role_sets(worker: Doc) -> None:
    assert list(validator().iter_errors(merged(VALUES, {"worker": worker})))


def test_the_schema_takes_the_role_sets() -> None:
    assert not list(validator().iter_errors(merged(VALUES, {"worker": BOTH})))
    with_threshold = {"scheduler": {"disaggregationThreshold": 0}}
    assert not list(validator().iter_errors(merged(VALUES, with_threshold)))
    below_zero = {"scheduler": {"disaggregationThreshold": -1}}
    assert list(validator().iter_errors(merged(VALUES, below_zero)))
