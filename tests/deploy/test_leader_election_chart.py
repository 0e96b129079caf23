"""The chart's scheduler leader election (scheduler.replicas > 1), rendered by a real helm: a
Lease per shard named in the scheduler's environment and in a Role that allows those Leases
and nothing else, bound to the scheduler's own ServiceAccount, whose token only these pods
mount; rolling updates that bring a standby up first; timings the scheduler accepts."""

from __future__ import annotations

import json

import pytest

from services.scheduler.config import SchedulerServiceConfig
from services.scheduler.main import build_parser
from tests.deploy.test_chart_render import find, pod_spec, render

ELECTED = 'scheduler={"replicas": 2, "shards": 3}'


def schedulers(docs) -> list[dict]:
    return [
        d
        for d in docs
        if d["kind"] == "Deployment"
        and d["metadata"]["labels"]["app.kubernetes.io/component"] == "scheduler"
    ]


def env_of(deployment: dict) -> dict:
    (container,) = pod_spec(deployment)["containers"]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_one_replica_runs_no_election_and_mounts_no_token():
    docs = render(None)
    (scheduler,) = schedulers(docs)
    assert scheduler["spec"]["replicas"] == 1
    assert scheduler["spec"]["strategy"] == {"type": "Recreate"}
    assert pod_spec(scheduler)["automountServiceAccountToken"] is False
    assert not any(name.startswith("SKIFF_LEADER_ELECTION") for name in env_of(scheduler))
    assert not [d for d in docs if d["kind"] in ("Role", "RoleBinding")]


def test_replicas_elect_a_leader_on_a_lease_per_shard():
    docs = render(None, ELECTED)
    deployments = schedulers(docs)
    assert len(deployments) == 3
    role = find(docs, "Role", "skiff-scheduler-leader-election")
    binding = find(docs, "RoleBinding", "skiff-scheduler-leader-election")
    account = find(docs, "ServiceAccount", "skiff-scheduler")
    leases = []
    for d in deployments:
        spec, pod, env = d["spec"], pod_spec(d), env_of(d)
        assert spec["replicas"] == 2
        assert spec["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
        assert pod["automountServiceAccountToken"] is True
        assert pod["serviceAccountName"] == account["metadata"]["name"]
        assert env["SKIFF_LEADER_ELECTION"] == "true"
        assert env["SKIFF_LEADER_ELECTION_IDENTITY"] == {"fieldRef": {"fieldPath": "metadata.name"}}
        assert env["SKIFF_LEADER_ELECTION_NAMESPACE"] == {
            "fieldRef": {"fieldPath": "metadata.namespace"}
        }
        leases.append(env["SKIFF_LEADER_ELECTION_LEASE_NAME"])
    assert leases == [d["metadata"]["name"] for d in deployments]  # one per shard, distinct
    create, named = role["rules"]
    assert create == {
        "apiGroups": ["coordination.k8s.io"],
        "resources": ["leases"],
        "verbs": ["create"],
    }
    assert named == {
        "apiGroups": ["coordination.k8s.io"],
        "resources": ["leases"],
        "resourceNames": leases,
        "verbs": ["get", "update", "patch"],
    }
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "skiff-scheduler", "namespace": "llm"}
    ]


def test_the_chart_timings_are_valid_scheduler_settings(monkeypatch):
    (scheduler, *_) = schedulers(render(None, ELECTED))
    for name, value in env_of(scheduler).items():
        if name.startswith("SKIFF_LEADER_ELECTION_") and isinstance(value, str):
            monkeypatch.setenv(name, value)
    _, configs = build_parser().parse_configs([])
    config = configs[SchedulerServiceConfig]
    assert config.leader_election_lease_duration == 6.0
    assert config.leader_election_renew_deadline == 4.0
    assert config.leader_election_retry_period == 1.0
    assert config.lease_name == "skiff-scheduler-0"


def test_an_own_or_chart_created_service_account_is_bound_and_not_created_twice():
    own = 'scheduler={"replicas": 2, "serviceAccount": {"name": "platform-sa"}}'
    docs = render(None, own)
    (scheduler,) = schedulers(docs)
    assert pod_spec(scheduler)["serviceAccountName"] == "platform-sa"
    assert not [
        d for d in docs if d["kind"] == "ServiceAccount" and "scheduler" in d["metadata"]["name"]
    ]
    binding = find(docs, "RoleBinding", "skiff-scheduler-leader-election")
    assert binding["subjects"][0]["name"] == "platform-sa"

    created = json.dumps(
        {"replicas": 2, "serviceAccount": {"create": True, "annotations": {"iam": "role"}}}
    )
    docs = render(None, f"scheduler={created}")
    (account,) = [
        d
        for d in docs
        if d["kind"] == "ServiceAccount" and d["metadata"]["name"] == "skiff-scheduler"
    ]
    assert account["metadata"]["annotations"] == {"iam": "role"}
    assert (
        find(docs, "RoleBinding", "skiff-scheduler-leader-election")["subjects"][0]["name"]
        == "skiff-scheduler"
    )


def test_timings_the_election_refuses_fail_the_render():
    bad = 'scheduler={"replicas": 2, "leaderElection": {"renewDeadlineSeconds": 6}}'
    with pytest.raises(AssertionError, match="leaseDurationSeconds > renewDeadlineSeconds"):
        render(None, bad)


def gateway_readiness(docs) -> dict:
    (gateway,) = [
        d
        for d in docs
        if d["kind"] == "Deployment"
        and d["metadata"]["labels"]["app.kubernetes.io/component"] == "gateway"
    ]
    (container,) = pod_spec(gateway)["containers"]
    return container["readinessProbe"]


@pytest.mark.parametrize("lease_s", [6, 15])
def test_the_gateway_stays_in_its_service_through_a_leader_handover(lease_s):
    """A handover leaves /health 503 for up to the lease duration, a retry period and the new
    leader's first heartbeats (3 s allowed); the gateway must fail probes for longer than that
    before it leaves its Service."""
    election = {"leaseDurationSeconds": lease_s, "renewDeadlineSeconds": lease_s - 2}
    docs = render(None, f"scheduler={json.dumps({'replicas': 2, 'leaderElection': election})}")
    probe = gateway_readiness(docs)
    handover_s = lease_s + 1 + 3  # retryPeriodSeconds 1
    assert probe["periodSeconds"] * (probe["failureThreshold"] - 1) >= handover_s
    # one scheduler: nothing to hand over, the gateway leaves within two probes
    assert gateway_readiness(render(None))["failureThreshold"] == 2
