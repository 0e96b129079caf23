"""etcd and the local cluster's kube-apiserver alone, on 127.0.0.1 ports of their own, with the
same authentication as LocalCluster's (client certificates, RBAC, service-account tokens signed
by the API server: TokenRequest and TokenReview): for tests of the API itself, which need no
node, no images and no root. No controllers run: objects are created by the test, namespaces are
not finalized, pods are never scheduled (a token can still be bound to one)."""

from __future__ import annotations

import contextlib
import shutil
import ssl
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
from kubernetes import client, config

from services.launcher import free_port
from tests.cluster.kube import wait_until
from tests.cluster.localkube.cluster import BIN, SERVICE_CIDR, build_binaries
from tests.cluster.localkube.pki import Pki, make_pki

ISSUER = "https://kubernetes.default.svc.cluster.local"


@dataclass
class ApiServer:
    url: str
    pki: Pki

    @property
    def kubeconfig(self) -> Path:
        return self.pki.kubeconfig("admin")

    def api(self) -> client.ApiClient:
        return config.new_client_from_config(str(self.kubeconfig))

    def ready(self) -> bool:
        with contextlib.suppress(httpx.HTTPError):
            ctx = ssl.create_default_context(cafile=str(self.pki.ca))
            ctx.load_cert_chain(str(self.pki.cert("admin")), str(self.pki.key("admin")))
            return httpx.get(f"{self.url}/readyz", verify=ctx, timeout=2).status_code == 200
        return False


def _argv(binary: Path, pki: Pki, etcd: str, port: int) -> list[str]:
    return [
        str(binary), f"--etcd-servers={etcd}",
        "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
        f"--secure-port={port}", "--insecure-port=0",
        f"--tls-cert-file={pki.cert('apiserver')}",
        f"--tls-private-key-file={pki.key('apiserver')}",
        f"--client-ca-file={pki.ca}",
        f"--service-account-key-file={pki.dir / 'sa.pub'}",
        f"--service-account-signing-key-file={pki.dir / 'sa.key'}",
        f"--service-account-issuer={ISSUER}", f"--service-cluster-ip-range={SERVICE_CIDR}",
        "--authorization-mode=RBAC", "--profiling=false", "--v=1",
    ]  # fmt: skip


@contextlib.contextmanager
def running() -> Iterator[ApiServer]:
    binary = BIN / "kube-apiserver"  # alone, or built with the rest of the cluster's
    if not binary.exists():
        binary = build_binaries() / "kube-apiserver"
    state = Path(tempfile.mkdtemp(prefix="skiff-apiserver-"))
    port, etcd_client, etcd_peer = free_port(), free_port(), free_port()
    url = f"https://127.0.0.1:{port}"
    pki = make_pki(state / "pki", url, ["127.0.0.1"])
    etcd_url = f"http://127.0.0.1:{etcd_client}"
    procs: list[subprocess.Popen[bytes]] = []
    log = (state / "log").open("ab")
    try:
        procs.append(subprocess.Popen([
            "etcd", "--name", "local", "--data-dir", str(state / "etcd"),
            "--listen-client-urls", etcd_url, "--advertise-client-urls", etcd_url,
            "--listen-peer-urls", f"http://127.0.0.1:{etcd_peer}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{etcd_peer}",
            "--initial-cluster", f"local=http://127.0.0.1:{etcd_peer}",
            "--listen-metrics-urls", "",
        ], stdout=log, stderr=subprocess.STDOUT))  # fmt: skip
        procs.append(
            subprocess.Popen(
                _argv(binary, pki, etcd_url, port), stdout=log, stderr=subprocess.STDOUT
            )
        )
        server = ApiServer(url, pki)
        try:
            wait_until("the API server ready", server.ready, 90, every_s=0.5)
        except AssertionError:
            raise AssertionError((state / "log").read_text()[-3000:]) from None
        yield server
    finally:
        for proc in reversed(procs):
            proc.terminate()
            proc.wait(30)
        log.close()
        shutil.rmtree(state, ignore_errors=True)
