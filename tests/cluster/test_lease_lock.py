"""The scheduler's Lease lock and leader election against a real API server, as the chart's
scheduler ServiceAccount: the chart's RBAC objects and Lease (rendered by helm) in a namespace of
their own, and a token of that account from the TokenRequest API."""

from __future__ import annotations

import asyncio
import datetime
import json
import time
import uuid

import pytest
import yaml
from kubernetes import client, utils
from kubernetes.aio.client import ApiClient, Configuration
from kubernetes.aio.leaderelection.leaderelectionrecord import LeaderElectionRecord

from services.scheduler.leader import LeaderElector
from services.scheduler.lease_lock import KubernetesLeaseLock
from tests.cluster import kube

pytestmark = pytest.mark.e2e

LEASE = "skiff-scheduler"  # the chart's Lease of a one-shard release named "skiff"
LEASE_S, RENEW_S, RETRY_S = 4.0, 3.0, 1.0


@pytest.fixture(scope="module")
def scheduler_account(cluster, helm):
    """(namespace, token, CA file) of the chart's scheduler ServiceAccount, with its Role."""
    core = client.CoreV1Api(cluster.api)
    namespace = f"lease-test-{uuid.uuid4().hex[:6]}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace)))
    rendered = helm(
        "template", "skiff", str(kube.CHART), "-n", namespace,
        "--show-only", "templates/scheduler-rbac.yaml", "--set", "scheduler.replicas=2",
    )  # fmt: skip
    objects = [o for o in yaml.safe_load_all(rendered) if o]
    assert {o["kind"] for o in objects} == {"ServiceAccount", "Role", "RoleBinding", "Lease"}
    utils.create_from_yaml(cluster.api, yaml_objects=objects, namespace=namespace)
    request = client.AuthenticationV1TokenRequest(
        spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=3600)
    )
    token = core.create_namespaced_service_account_token(LEASE, namespace, request).status.token
    try:
        yield namespace, token, cluster.api.configuration.ssl_ca_cert
    finally:
        core.delete_namespace(namespace)


def lock_of(cluster, account, identity: str, lease: str = LEASE) -> KubernetesLeaseLock:
    namespace, token, ca = account
    config = Configuration(
        host=cluster.api.configuration.host,
        api_key={"BearerToken": token},
        api_key_prefix={"BearerToken": "Bearer"},
        ssl_ca_cert=ca,
    )
    return KubernetesLeaseLock(lease, namespace, identity, ApiClient(config))


def record(identity: str) -> LeaderElectionRecord:
    now = str(datetime.datetime.now())
    return LeaderElectionRecord(identity, str(LEASE_S), now, now)


def test_the_lock_creates_reads_and_updates_the_lease_with_conflicts_refused(
    cluster, scheduler_account
):
    namespace = scheduler_account[0]
    coordination = client.CoordinationV1Api(cluster.api)

    async def run() -> None:
        a, b = lock_of(cluster, scheduler_account, "a"), lock_of(cluster, scheduler_account, "b")
        found, empty = await a.get(LEASE, namespace)  # the chart's Lease, no holder yet
        assert found and empty.holder_identity is None
        coordination.delete_namespaced_lease(LEASE, namespace)
        found, error = await a.get(LEASE, namespace)
        assert not found and json.loads(error.body)["code"] == 404
        assert await a.create(LEASE, namespace, record("a"))
        assert not await b.create(LEASE, namespace, record("b"))  # 409: a was first
        found, seen = await b.get(LEASE, namespace)
        assert found and seen.holder_identity == "a"
        assert await a.get(LEASE, namespace) and await a.update(LEASE, namespace, record("a"))
        assert not await b.update(LEASE, namespace, record("b"))  # 409: changed since b's get
        assert (await b.get(LEASE, namespace))[0] and await b.update(LEASE, namespace, record("b"))
        lease = coordination.read_namespaced_lease(LEASE, namespace).spec
        assert (lease.holder_identity, lease.lease_transitions) == ("b", 1)
        assert lease.lease_duration_seconds == int(LEASE_S)
        other = lock_of(cluster, scheduler_account, "a", lease="someone-elses")
        found, error = await other.get("someone-elses", namespace)
        assert not found and error.status == 403  # the Role names the chart's Leases only

    asyncio.run(run())


def test_a_standby_takes_over_a_lease_duration_after_the_leader_dies(cluster, scheduler_account):
    """Two electors on the real Lease: one leads; it dies without a word (its tasks cancelled,
    the Lease left as it was); the other leads within a lease duration and a retry period."""

    async def run() -> float:
        leading: dict[str, asyncio.Event] = {n: asyncio.Event() for n in ("a", "b")}

        def elector(name: str) -> LeaderElector:
            async def lead() -> None:
                leading[name].set()
                await asyncio.Event().wait()

            return LeaderElector(
                lock_of(cluster, scheduler_account, name),
                lease_duration_s=LEASE_S,
                renew_deadline_s=RENEW_S,
                retry_period_s=RETRY_S,
                on_started_leading=lead,
                on_stopped_leading=lambda reason: None,
            )

        a = asyncio.create_task(elector("a").run())
        await asyncio.wait_for(leading["a"].wait(), 30)
        b = asyncio.create_task(elector("b").run())
        await asyncio.sleep(2 * LEASE_S)
        assert not leading["b"].is_set()  # a renews: b stands by
        a.cancel()
        died = time.monotonic()
        await asyncio.wait_for(leading["b"].wait(), 3 * LEASE_S)
        took_over = time.monotonic() - died
        b.cancel()
        return took_over

    took_over_s = asyncio.run(run())
    assert took_over_s <= LEASE_S + RETRY_S + 1.0, took_over_s
