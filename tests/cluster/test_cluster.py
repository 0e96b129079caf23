"""The cpu profile on a real cluster: streams through the gateway Service while a worker pod is
deleted, the leading scheduler is killed and the release is upgraded, with every stream
completing; then `helm uninstall` leaves nothing behind (conftest.py says where this runs).
The tests run in file order on one release; the last one uninstalls it."""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from tests.cluster import kube

pytestmark = pytest.mark.e2e

MAX_TOKENS = 64
HANDOVER_WATCH_S = 25  # from a leader's death: the takeover and three failing gateway probes


def stream_tokens(openai_client, key: str, on_token: Callable[[], None]) -> tuple[int, str]:
    """One completion streamed to its end: (completion tokens, finish_reason)."""
    model = openai_client.models.list().data[0].id
    tokens, finish = 0, None
    stream = openai_client.completions.create(
        model=model,
        prompt=f"Count to a thousand ({key}):",
        max_tokens=MAX_TOKENS,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    for chunk in stream:
        on_token()
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
        if chunk.choices:
            finish = chunk.choices[0].finish_reason or finish
    return tokens, finish


@contextmanager
def streaming(openai_client, n: int = 2) -> Iterator[list[tuple[str, int, str | None]]]:
    """`n` clients streaming completions back to back for as long as the block runs (it starts
    once each has a first token); every stream is checked complete at the end."""
    done: list[tuple[str, int, str | None]] = []
    failures: list[str] = []
    stop = threading.Event()
    started = [threading.Event() for _ in range(n)]

    def client(i: int) -> None:
        count = 0
        while not stop.is_set():
            key = f"c{i}-{count}"
            try:
                tokens, finish = stream_tokens(openai_client, key, started[i].set)
            except Exception as exc:  # a lost stream: reported, not raised in a thread
                failures.append(f"{key}: {type(exc).__name__}: {exc}")
                started[i].set()
                return
            done.append((key, tokens, finish))
            count += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    try:
        for s in started:
            assert s.wait(180), "no first token within 180 s"
        yield done
    finally:
        stop.set()
        for t in threads:
            t.join(600)
    assert not failures, failures
    incomplete = [d for d in done if d[1:] != (MAX_TOKENS, "length")]
    assert not incomplete, incomplete  # every token of every stream, none lost
    assert len(done) >= n


def test_the_openai_client_streams_through_the_gateway_service(openai_client):
    models = [m.id for m in openai_client.models.list().data]
    assert models
    stream = openai_client.chat.completions.create(
        model=models[0],
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=16,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text.strip()


def test_a_worker_pod_deleted_mid_stream(k8s, release, openai_client):
    core = k8s[0]
    namespace, name = release
    victim = f"{name}-worker-0"
    before = core.read_namespaced_pod(victim, namespace).metadata.uid
    with streaming(openai_client):
        core.delete_namespaced_pod(victim, namespace)  # SIGTERM: its requests move at once
        time.sleep(5)
    kube.wait_until(
        "the StatefulSet replaces the deleted worker",
        lambda: any(
            p.metadata.uid != before and p.metadata.name == victim
            for p in kube.ready_pods(core, namespace, name, "worker")
        ),
        600,
    )


@contextmanager
def gateway_endpoints(core, namespace: str, service) -> Iterator[list[int]]:
    """The number of ready addresses behind the gateway's Service, read every 0.5 s for as
    long as the block runs."""
    counts: list[int] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            endpoints = core.read_namespaced_endpoints(service.metadata.name, namespace)
            counts.append(sum(len(s.addresses or []) for s in endpoints.subsets or []))
            stop.wait(0.5)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        yield counts
    finally:
        stop.set()
        watcher.join(30)


def lease_holders(coordination, core, namespace: str, release: str) -> dict[str, tuple[str, str]]:
    """{Lease name: (holding scheduler pod, holder identity)} for the Leases held by this
    release's schedulers (an identity is the pod's name and a per-process suffix)."""
    pods = {p.metadata.name for p in kube.ready_pods(core, namespace, release, "scheduler")}
    held = {}
    for lease in coordination.list_namespaced_lease(namespace).items:
        holder = (lease.spec and lease.spec.holder_identity) or ""
        for pod in pods:
            if holder.startswith(f"{pod}_"):
                held[lease.metadata.name] = (pod, holder)
    return held


def sigkill(cluster, core, namespace: str, pod: str) -> None:
    """SIGKILL the pod's containers' processes (through containerd on the local cluster; else
    the pod is deleted with no grace period)."""
    if cluster.local is None:
        core.delete_namespaced_pod(pod, namespace, grace_period_seconds=0)
        return
    for status in core.read_namespaced_pod(pod, namespace).status.container_statuses:
        container = status.container_id.removeprefix("containerd://")
        ctr = ["ctr", "--address", str(cluster.local.socket), "-n", "k8s.io", "tasks", "kill"]
        subprocess.run([*ctr, "--signal", "SIGKILL", container], check=True, capture_output=True)


def test_killing_the_leader_scheduler_hands_over(cluster, k8s, release, openai_client):
    core, apps, coordination, _ = k8s
    namespace, name = release
    held = kube.wait_until(
        "a scheduler holding its Lease",
        lambda: lease_holders(coordination, core, namespace, name),
        120,
    )
    (lease_name, (leader, leader_identity)), *_ = held.items()
    lease = coordination.read_namespaced_lease(lease_name, namespace).spec
    (deployment,) = kube.deployments(apps, namespace, name, "scheduler")
    env = {e.name: e.value for e in deployment.spec.template.spec.containers[0].env}
    retry_s = float(env["SKIFF_LEADER_ELECTION_RETRY_PERIOD"])
    (gateway,) = kube.services(core, namespace, name, "gateway")
    with streaming(openai_client), gateway_endpoints(core, namespace, gateway) as endpoints:
        sigkill(cluster, core, namespace, leader)
        killed_at = time.monotonic()
        new = kube.wait_until(
            "a standby taking the Lease over",
            lambda: (
                (h := lease_holders(coordination, core, namespace, name).get(lease_name))
                and h[1] != leader_identity
                and h
            ),
            120,
            every_s=0.2,
        )
        took_over_s = time.monotonic() - killed_at
        # streams keep going on the new leader; the gateway's readiness probes go on failing
        # until it heard from the new leader's workers: it must outlast them in its Service
        time.sleep(max(3.0, HANDOVER_WATCH_S - took_over_s))
    assert endpoints and min(endpoints) > 0, endpoints  # never left without a gateway
    # the other replica, or the killed one's restarted container: a new process either way
    assert new[1] != leader_identity
    # the standby waits a lease duration after the Lease's last change, then one retry period;
    # 2 s for this test's polling and the API round trips
    assert took_over_s <= lease.lease_duration_seconds + retry_s + 2, took_over_s
    after = openai_client.completions.create(
        model=openai_client.models.list().data[0].id, prompt="Hi", max_tokens=8
    )
    assert after.choices[0].finish_reason in ("length", "stop")


def test_helm_upgrade_rolls_workers_one_at_a_time(cluster, k8s, helm, release, openai_client):
    core, apps, _, _ = k8s
    namespace, name = release
    (workers,) = kube.stateful_sets(apps, namespace, name, "worker")
    before = workers.status.current_revision
    ready_counts: list[int] = []
    watching = threading.Event()

    def watch() -> None:
        while not watching.is_set():
            ready_counts.append(len(kube.ready_pods(core, namespace, name, "worker")))
            time.sleep(0.5)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with streaming(openai_client):
            helm(
                "upgrade", name, str(kube.CHART), "-n", namespace, "--reuse-values",
                "--set-json", "worker.kvCacheGiB=0.75",
                "--wait", "--timeout=15m",
            )  # fmt: skip
    finally:
        watching.set()
        watcher.join()
    (workers,) = kube.stateful_sets(apps, namespace, name, "worker")
    assert workers.status.update_revision != before
    assert workers.status.current_revision == workers.status.update_revision
    assert min(ready_counts) >= workers.spec.replicas - 1, ready_counts  # one at a time
    pods = kube.ready_pods(core, namespace, name, "worker")
    assert len(pods) == workers.spec.replicas
    for pod in pods:
        env = {e.name: e.value for e in pod.spec.containers[0].env}
        assert env["SKIFF_KV_CACHE_GIB"] == "0.75", pod.metadata.name


def test_network_policies_are_admitted(k8s, release):
    namespace, name = release
    api = k8s[3]
    networking = api.NetworkingV1Api(k8s[0].api_client)
    selector = f"app.kubernetes.io/instance={name}"
    policies = networking.list_namespaced_network_policy(namespace, label_selector=selector)
    names = {p.metadata.name for p in policies.items}
    assert names == {f"{name}-{c}" for c in ("nats", "gateway", "scheduler", "worker")}


def test_helm_uninstall_leaves_no_object_of_the_release(cluster, k8s, helm, release):
    namespace, name = release
    assert kube.release_objects(cluster.api, namespace, name), "nothing to uninstall"
    helm("uninstall", name, "-n", namespace, "--wait")
    kube.wait_until(
        "every object of the release gone",
        lambda: not kube.release_objects(cluster.api, namespace, name),
        180,
    )
