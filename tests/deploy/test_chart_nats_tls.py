"""NATS TLS in the chart, on by default: the certificate the chart generates (valid for the
client Service and the cluster routes' names, usable by a real nats-server), every service on
tls:// with the CA, the routes of a NATS cluster over TLS with a route password, a Secret of
the user's instead, TLS off, and an external NATS that needs its CA named."""

from __future__ import annotations

import asyncio
import base64
import subprocess

import nats
import nats.errors
import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from services.launcher import free_port, nats_server_binary
from shared import bus
from shared.nats_auth import ServerTls, server_config
from tests.deploy.test_chart_render import (
    CRD_API_VERSIONS,
    HELM,
    MULTI_GPU,
    find,
    pod_spec,
    render,
    workloads,
)
from tests.deploy.test_deploy import CHART, VALUES, merged, validator

SERVICES = ("gateway", "scheduler", "worker")
NAMES = ["skiff-nats", "skiff-nats.llm", "skiff-nats.llm.svc", "skiff-nats.llm.svc.cluster.local"]


def _secret_files(docs, name: str) -> dict[str, bytes]:
    return {k: base64.b64decode(v) for k, v in find(docs, "Secret", name)["data"].items()}


def _env(doc: dict) -> dict[str, str]:
    (c,) = pod_spec(doc)["containers"]
    return {e["name"]: e.get("value") for e in c["env"]}


def _volumes(doc: dict) -> dict[str, dict]:
    return {v["name"]: v for v in pod_spec(doc).get("volumes", [])}


def test_tls_is_on_by_default_with_a_generated_certificate():
    docs = render(None)
    secret = find(docs, "Secret", "skiff-nats-tls")
    assert secret["type"] == "kubernetes.io/tls"
    files = _secret_files(docs, "skiff-nats-tls")
    assert set(files) == {"ca.crt", "tls.crt", "tls.key"}
    ca = x509.load_pem_x509_certificate(files["ca.crt"])
    cert = x509.load_pem_x509_certificate(files["tls.crt"])
    cert.verify_directly_issued_by(ca)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    names = sans.get_values_for_type(x509.DNSName)
    assert set(NAMES) <= set(names)
    assert "*.skiff-nats-cluster.llm.svc" in names  # skiff-nats-<i>.skiff-nats-cluster.llm.svc
    usages = set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
    assert {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH} <= usages

    nats_set = find(docs, "StatefulSet", "skiff-nats")
    assert _volumes(nats_set)["tls"]["secret"]["secretName"] == "skiff-nats-tls"
    (init,) = pod_spec(nats_set)["initContainers"]
    assert "--tls-cert=/etc/nats/tls/tls.crt" in init["command"]
    for doc in workloads(docs):
        if doc["metadata"]["labels"]["app.kubernetes.io/component"] == "nats":
            continue
        env = _env(doc)
        assert env["SKIFF_NATS_URL"] == "tls://skiff-nats:4222"
        assert env["SKIFF_NATS_TLS_CA"] == "/etc/skiff/nats-tls/ca.crt"
        volume = _volumes(doc)["nats-tls"]["secret"]
        assert volume == {
            "secretName": "skiff-nats-tls",
            "items": [{"key": "ca.crt", "path": "ca.crt"}],
        }


def test_tls_off_and_a_secret_of_ones_own():
    off = render(None, '{"nats": {"tls": {"enabled": false}}}')
    assert not [
        d for d in off if d["kind"] == "Secret" and d["metadata"]["name"] == "skiff-nats-tls"
    ]
    gateway = find(off, "Deployment", "skiff-gateway")
    assert _env(gateway)["SKIFF_NATS_URL"] == "nats://skiff-nats:4222"
    assert "SKIFF_NATS_TLS_CA" not in _env(gateway) and "nats-tls" not in _volumes(gateway)

    own = render(None, '{"nats": {"tls": {"secretName": "from-cert-manager"}}}')
    assert not [d for d in own if d["metadata"]["name"] == "skiff-nats-tls"]
    nats_set = find(own, "StatefulSet", "skiff-nats")
    assert _volumes(nats_set)["tls"]["secret"]["secretName"] == "from-cert-manager"
    gateway = find(own, "Deployment", "skiff-gateway")
    assert _volumes(gateway)["nats-tls"]["secret"]["secretName"] == "from-cert-manager"


def test_an_external_nats_needs_its_ca_named():
    external = {"nats": {"bundled": False, "url": "tls://nats.nats.svc:4222"}}
    assert list(validator().iter_errors(merged(VALUES, external)))
    assert not list(
        validator().iter_errors(
            merged(VALUES, merged(external, {"nats": {"tls": {"enabled": False}}}))
        )
    )
    if HELM is None:
        pytest.skip("no helm binary")
    cmd = [HELM, "template", "skiff", str(CHART), "-n", "llm", "--api-versions", CRD_API_VERSIONS]
    cmd += ["--set", "nats.bundled=false", "--set", "nats.url=tls://nats.nats.svc:4222"]
    for extra, message in (
        ([], "/nats/tls/secretName"),
        (["--skip-schema-validation"], "nats.tls:"),
    ):
        done = subprocess.run(
            [*cmd, *extra], capture_output=True, text=True, timeout=120, check=False
        )
        assert done.returncode != 0 and message in done.stderr, done.stderr
    docs = render(
        None, '{"nats": {"bundled": false, "url": "tls://n:4222", "tls": {"secretName": "ca"}}}'
    )
    assert not [d for d in docs if d["metadata"]["name"] == "skiff-nats-tls"]
    gateway = find(docs, "Deployment", "skiff-gateway")
    assert _env(gateway)["SKIFF_NATS_URL"] == "tls://n:4222"
    assert _volumes(gateway)["nats-tls"]["secret"]["secretName"] == "ca"


def test_cluster_routes_use_tls_and_a_route_password():
    docs = render(MULTI_GPU)
    nats_set = find(docs, "StatefulSet", "skiff-nats")
    (c,) = pod_spec(nats_set)["containers"]
    assert not [a for a in c["command"] if a.startswith(("--routes", "--cluster"))]
    assert "--config=/etc/nats/config/nats.conf" in c["command"]
    (init,) = pod_spec(nats_set)["initContainers"]
    routes = [a.split("=", 1)[1] for a in init["command"] if a.startswith("--cluster-route=")]
    assert routes == [f"nats://skiff-nats-{i}.skiff-nats-cluster.llm.svc:6222" for i in range(3)]
    assert "--cluster-name=skiff-nats" in init["command"]
    assert "--cluster-tls-ca=/etc/nats/tls/ca.crt" in init["command"]
    assert "--route-password-file=/etc/nats/auth/route" in init["command"]
    auth = find(docs, "Secret", "skiff-nats-auth")["data"]
    assert "route" in auth
    for doc in workloads(docs):  # no client gets the route password
        items = _volumes(doc).get("nats-auth", {}).get("secret", {}).get("items", [])
        assert "route" not in [i["key"] for i in items]
    single = find(render(None), "Secret", "skiff-nats-auth")["data"]
    assert "route" not in single  # one server: no routes


@pytest.mark.e2e  # starts nats-server
def test_a_nats_server_serves_the_generated_certificate(tmp_path):
    """The chart's Secret as the bundled server uses it: clients verifying the CA reach it by
    the Service's names and a route's name, and not by a name the certificate lacks."""
    files = _secret_files(render(None), "skiff-nats-tls")
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    tls = ServerTls(str(tmp_path / "tls.crt"), str(tmp_path / "tls.key"))
    conf = tmp_path / "nats.conf"
    conf.write_text(server_config(None, "skiff", 1, tls=tls))
    port = free_port()
    argv = [nats_server_binary(), "-a", "127.0.0.1", "-p", str(port), "-c", str(conf)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    async def attempt(hostname: str) -> None:
        nc = await nats.connect(
            f"tls://127.0.0.1:{port}",
            allow_reconnect=False,
            max_reconnect_attempts=0,
            connect_timeout=5,
            tls_hostname=hostname,
            **bus.ConnectOptions(tls_ca=str(tmp_path / "ca.crt")).nats_kwargs(),
        )
        await nc.flush(timeout=5)
        await nc.close()

    try:
        for _ in range(100):  # until it listens
            try:
                asyncio.run(attempt("skiff-nats"))
                break
            except (nats.errors.NoServersError, OSError):
                assert proc.poll() is None, "nats-server exited"
        for hostname in [*NAMES, "skiff-nats-2.skiff-nats-cluster.llm.svc"]:
            asyncio.run(attempt(hostname))
        with pytest.raises((nats.errors.Error, OSError)):
            asyncio.run(attempt("elsewhere.llm.svc"))
    finally:
        proc.terminate()
        proc.wait(timeout=10)
