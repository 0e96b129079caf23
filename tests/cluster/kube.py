"""Helpers of the real-cluster suite: the kubernetes client, helm, readiness and port-forwards."""

from __future__ import annotations

import contextlib
import json
import re
import select
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kubernetes import client
from kubernetes.stream import portforward

CHART = Path(__file__).resolve().parents[2] / "charts" / "skiff"


def component_selector(release: str, component: str) -> str:
    """The label selector of one component's objects in a release."""
    return f"app.kubernetes.io/instance={release},app.kubernetes.io/component={component}"


def wait_until(what: str, check: Callable[[], Any], timeout_s: float, every_s: float = 2.0):
    """`check()`'s first truthy value, polled until `timeout_s`; fails naming `what`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(every_s)


def workloads_ready(apps: client.AppsV1Api, namespace: str, release: str) -> bool:
    """Every Deployment and StatefulSet of the release has all its replicas ready and updated."""
    selector = f"app.kubernetes.io/instance={release}"
    objs = [
        *apps.list_namespaced_deployment(namespace, label_selector=selector).items,
        *apps.list_namespaced_stateful_set(namespace, label_selector=selector).items,
    ]
    return bool(objs) and all(
        (o.status.ready_replicas or 0) == o.spec.replicas
        and (o.status.updated_replicas or 0) == o.spec.replicas
        for o in objs
    )


def ready_pods(core: client.CoreV1Api, namespace: str, release: str, component: str) -> list:
    selector = component_selector(release, component)
    pods = core.list_namespaced_pod(namespace, label_selector=selector).items
    return [
        p
        for p in pods
        if p.metadata.deletion_timestamp is None
        and any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])
    ]


def deployments(apps: client.AppsV1Api, namespace: str, release: str, component: str) -> list:
    selector = component_selector(release, component)
    return apps.list_namespaced_deployment(namespace, label_selector=selector).items


def stateful_sets(apps: client.AppsV1Api, namespace: str, release: str, component: str) -> list:
    selector = component_selector(release, component)
    return apps.list_namespaced_stateful_set(namespace, label_selector=selector).items


def release_objects(api: client.ApiClient, namespace: str, release: str) -> list[str]:
    """`kind/name` of every object in `namespace` that belongs to the release: labelled as
    its instance or named after it (pods, Leases and Endpoints included), events excepted."""
    found = []
    for kind, path in _namespaced_resources(api, namespace):
        for item in _get(api, path).get("items", []):
            meta = item["metadata"]
            labels = meta.get("labels") or {}
            if labels.get("app.kubernetes.io/instance") == release or meta["name"].startswith(
                f"{release}-"
            ):
                found.append(f"{kind}/{meta['name']}")
    return found


def _namespaced_resources(api: client.ApiClient, namespace: str) -> list[tuple[str, str]]:
    """(kind, list path) of every listable namespaced resource the server serves."""
    groups = ["/api/v1"]
    for group in client.ApisApi(api).get_api_versions().groups:
        groups.append(f"/apis/{group.preferred_version.group_version}")
    resources = []
    for base in groups:
        for r in _get(api, base)["resources"]:
            listable = r["namespaced"] and "list" in r["verbs"] and "/" not in r["name"]
            if listable and r["kind"] != "Event":
                resources.append((r["kind"], f"{base}/namespaces/{namespace}/{r['name']}"))
    return resources


def _get(api: client.ApiClient, path: str) -> dict[str, Any]:
    """The JSON of a GET of `path` on the API server."""
    request = api.param_serialize("GET", path, auth_settings=["BearerToken"])
    response = api.call_api(*request, _request_timeout=30)
    response.read()
    assert response.status == 200, (path, response.status)
    return json.loads(response.data)


def services(core: client.CoreV1Api, namespace: str, release: str, component: str) -> list:
    selector = component_selector(release, component)
    return core.list_namespaced_service(namespace, label_selector=selector).items


def describe_failures(core: client.CoreV1Api, namespace: str) -> str:
    """Every pod's phase and waiting or terminated reasons, and the namespace's warning
    events: what a failed install leaves to read."""
    lines = []
    for pod in core.list_namespaced_pod(namespace).items:
        states = []
        for status in pod.status.container_statuses or []:
            state = status.state.waiting or status.state.terminated
            if state is not None:
                states.append(f"{status.name}: {state.reason} {state.message or ''}".strip())
        lines.append(f"pod {pod.metadata.name} {pod.status.phase} {'; '.join(states)}")
    for event in core.list_namespaced_event(namespace).items:
        if event.type == "Warning":
            lines.append(f"event {event.involved_object.name}: {event.reason}: {event.message}")
    return "\n".join(lines)


def helm(helm_bin: str, *args: str) -> str:
    done = subprocess.run([helm_bin, *args], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr + done.stdout
    return done.stdout


@contextlib.contextmanager
def port_forward(core: client.CoreV1Api, namespace: str, pod: str, port: int) -> Iterator[int]:
    """A local port forwarded to `pod`:`port`: `kubectl port-forward` where kubectl exists,
    else the kubernetes client's portforward bridged to a local listener."""
    kubectl = shutil.which("kubectl")
    if kubectl:
        cmd = [kubectl, "port-forward", "-n", namespace, f"pod/{pod}", f":{port}"]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            line = proc.stdout.readline() if proc.stdout else ""
            m = re.search(r"127\.0\.0\.1:(\d+)", line)
            assert m, f"kubectl port-forward: {line}"
            yield int(m[1])
        finally:
            proc.terminate()
            proc.wait(10)
        return
    with socket.create_server(("127.0.0.1", 0)) as listener:
        stop = threading.Event()

        def bridge(conn: socket.socket) -> None:
            pf = portforward(
                core.connect_get_namespaced_pod_portforward, pod, namespace, ports=str(port)
            )
            remote = pf.socket(port)
            with conn, remote:
                while not stop.is_set():
                    readable, _, _ = select.select([conn, remote], [], [], 0.5)
                    for src in readable:
                        data = src.recv(65536)
                        if not data:
                            return
                        (remote if src is conn else conn).sendall(data)
            pf.close()

        def accept() -> None:
            listener.settimeout(0.5)
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    conn, _ = listener.accept()
                    threading.Thread(target=bridge, args=(conn,), daemon=True).start()

        threading.Thread(target=accept, daemon=True).start()
        try:
            yield listener.getsockname()[1]
        finally:
            stop.set()
