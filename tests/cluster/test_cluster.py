"""The cpu profile on a real cluster: a worker pod deleted mid-stream and the leader scheduler
killed, with every stream completing (conftest.py says when this runs)."""

from __future__ import annotations

import threading
import time

import pytest

from tests.cluster import kube

pytestmark = pytest.mark.e2e

MAX_TOKENS = 200


def stream_tokens(openai_client, out: dict, key: str, started: threading.Event) -> None:
    """A completion streamed to its end; out[key] = (completion tokens, finish_reason)."""
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
        started.set()
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
        if chunk.choices:
            finish = chunk.choices[0].finish_reason or finish
    out[key] = (tokens, finish)


def run_streams(openai_client, n: int, during) -> dict:
    """`n` concurrent streams; `during()` runs once each has its first token."""
    out: dict = {}
    starts = [threading.Event() for _ in range(n)]
    threads = [
        threading.Thread(target=stream_tokens, args=(openai_client, out, f"s{i}", starts[i]))
        for i in range(n)
    ]
    for t in threads:
        t.start()
    for s in starts:
        assert s.wait(120), "no first token within 120 s"
    during()
    for t in threads:
        t.join(600)
    return out


def test_a_worker_pod_deleted_mid_stream(k8s, release, openai_client):
    core = k8s[0]
    namespace, name = release
    victim = f"{name}-worker-0"
    before = core.read_namespaced_pod(victim, namespace).metadata.uid

    def delete_worker():
        core.delete_namespaced_pod(victim, namespace)  # SIGTERM: its requests move at once

    out = run_streams(openai_client, 4, delete_worker)
    assert sorted(out) == ["s0", "s1", "s2", "s3"]
    for key, (tokens, finish) in out.items():
        assert finish == "length", (key, finish)
        assert tokens == MAX_TOKENS, (key, tokens)  # every token, none lost in the move
    kube.wait_until(
        "the StatefulSet replaces the deleted worker",
        lambda: any(
            p.metadata.uid != before and p.metadata.name == victim
            for p in kube.ready_pods(core, namespace, name, "worker")
        ),
        600,
    )


def lease_holders(coordination, core, namespace: str, release: str) -> dict[str, str]:
    """{Lease name: holding scheduler pod} for the Leases held by this release's schedulers (a
    holder identity starts with the pod's name, its host name)."""
    pods = {p.metadata.name for p in kube.ready_pods(core, namespace, release, "scheduler")}
    held = {}
    for lease in coordination.list_namespaced_lease(namespace).items:
        holder = lease.spec.holder_identity or ""
        for pod in pods:
            if holder.startswith(pod):
                held[lease.metadata.name] = pod
    return held


def test_killing_the_leader_scheduler_hands_over(k8s, release, openai_client):
    core, _, coordination, _ = k8s
    namespace, name = release
    held = kube.wait_until(
        "a scheduler holding its Lease",
        lambda: lease_holders(coordination, core, namespace, name),
        120,
    )
    (lease, leader), *_ = held.items()
    took_over_at: list[float] = []

    def kill_leader():
        core.delete_namespaced_pod(leader, namespace, grace_period_seconds=0)
        killed_at = time.monotonic()
        new = kube.wait_until(
            "a standby taking the Lease over",
            lambda: (
                (h := lease_holders(coordination, core, namespace, name).get(lease))
                and h != leader
                and h
            ),
            120,
            every_s=0.5,
        )
        took_over_at.append(time.monotonic() - killed_at)
        assert new != leader

    out = run_streams(openai_client, 2, kill_leader)
    for key, (tokens, finish) in out.items():
        assert finish == "length", (key, finish)
        assert tokens == MAX_TOKENS, (key, tokens)
    assert took_over_at and took_over_at[0] < 60, took_over_at
    after = openai_client.completions.create(
        model=openai_client.models.list().data[0].id, prompt="Hi", max_tokens=8
    )
    assert after.choices[0].finish_reason in ("length", "stop")
