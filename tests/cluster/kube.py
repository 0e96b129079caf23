"""Helpers of the real-cluster suite: the kubernetes client, helm, readiness and port-forwards."""

from __future__ import annotations

import contextlib
import re
import select
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from kubernetes import client
from kubernetes.stream import portforward


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
    selector = f"app.kubernetes.io/instance={release},app.kubernetes.io/component={component}"
    pods = core.list_namespaced_pod(namespace, label_selector=selector).items
    return [
        p
        for p in pods
        if p.metadata.deletion_timestamp is None
        and any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])
    ]


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
