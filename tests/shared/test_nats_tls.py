"""NATS over TLS: the certificates `skiff serve` generates (shared/local_tls.py), a stack's
nats-server refusing plaintext clients and clients that trust another CA, and cluster routes
rendered by shared/nats_auth.py (TLS both ways, a route password) between real nats-servers."""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import stat
import subprocess
import time
from pathlib import Path

import nats
import nats.errors
import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import load_pem_private_key
from cryptography.x509.oid import ExtendedKeyUsageOID

from services.launcher import Stack, StackConfig, StartupError, free_port, nats_server_binary
from services.worker.config import RunnerConfig
from shared import bus, local_tls
from shared.nats_auth import ROUTE_USER, Cluster, ServerTls, main, server_config


def test_local_certificates(tmp_path):
    certs = local_tls.generate(tmp_path)
    ca = x509.load_pem_x509_certificate(certs.ca.read_bytes())
    cert = x509.load_pem_x509_certificate(certs.cert.read_bytes())
    cert.verify_directly_issued_by(ca)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["localhost"]
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["127.0.0.1", "::1"]
    usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(usages) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    key = load_pem_private_key(certs.key.read_bytes(), None)
    assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp256r1"
    assert stat.S_IMODE(certs.key.stat().st_mode) == 0o600
    assert not list(tmp_path.glob("*ca.key"))  # the CA's key is never written
    # every client's check: a context trusting the CA accepts the chain for 127.0.0.1
    context = ssl.create_default_context(cafile=str(certs.ca))
    assert context.get_ca_certs()[0]["subject"] == ((("commonName", "skiff-nats local CA"),),)


def test_the_cluster_block_carries_route_tls_and_credentials():
    tls = ServerTls("/t/tls.crt", "/t/tls.key", "/t/ca.crt")
    routes = ("nats://s-0.c.ns.svc:6222", "nats://s-1.c.ns.svc:6222")
    text = server_config(None, "skiff", 1, cluster=Cluster("s", routes, tls=tls, password="p/w@"))
    cluster = json.loads(text.removeprefix("cluster "))
    assert cluster == {
        "name": "s",
        "listen": "0.0.0.0:6222",
        "routes": [
            f"nats://{ROUTE_USER}:p%2Fw%40@s-0.c.ns.svc:6222",
            f"nats://{ROUTE_USER}:p%2Fw%40@s-1.c.ns.svc:6222",
        ],
        "tls": {"cert_file": "/t/tls.crt", "key_file": "/t/tls.key", "ca_file": "/t/ca.crt"}
        | {"verify": True},
        "authorization": {"user": ROUTE_USER, "password": "p/w@"},
    }
    bare = json.loads(server_config(None, "skiff", 1, cluster=Cluster("s", routes))[8:])
    assert bare == {"name": "s", "listen": "0.0.0.0:6222", "routes": list(routes)}
    with pytest.raises(ValueError, match="CA"):
        Cluster("s", routes, tls=ServerTls("c", "k"))


def test_the_config_command_renders_a_cluster(tmp_path, capsys):
    out, password = tmp_path / "nats.conf", tmp_path / "route"
    password.write_text("secret\n")
    tls_args = ["--tls-cert", "/t/tls.crt", "--tls-key", "/t/tls.key"]
    routes = ["--cluster-route", "nats://a:6222", "--cluster-route", "nats://b:6222"]
    cluster_args = ["--cluster-name", "n", *routes, "--cluster-tls-ca", "/t/ca.crt"]
    main([*tls_args, *cluster_args, "--route-password-file", str(password), "--out", str(out)])
    text = out.read_text()
    assert text.startswith('tls {"cert_file": "/t/tls.crt", "key_file": "/t/tls.key"}\n')
    cluster = json.loads(text.split("\n", 1)[1].removeprefix("cluster "))
    assert cluster["routes"] == ["nats://route:secret@a:6222", "nats://route:secret@b:6222"]
    assert cluster["tls"]["ca_file"] == "/t/ca.crt"
    assert cluster["authorization"] == {"user": "route", "password": "secret"}
    bad = [
        [*routes, "--out", str(out)],  # routes without a cluster name
        ["--cluster-name", "n", "--out", str(out)],  # a name without routes
        ["--cluster-name", "n", *routes, "--cluster-tls-ca", "ca", "--out", str(out)],  # no cert
        ["--cluster-name", "n", *routes, "--route-password-file", "/no", "--out", str(out)],
    ]
    for argv in bad:
        with pytest.raises(SystemExit):
            main(argv)
    assert "key `route`" in capsys.readouterr().err  # the missing password file, named


@pytest.fixture
def tls_broker():
    """Our nats-server as a stack starts it by default: users and TLS, certificates generated."""
    server = Stack(StackConfig(RunnerConfig(model_dir=""), workers=1))
    server.start_nats()
    yield server
    server.stop()


def _info_and_reply(port: int, send: bytes) -> tuple[dict, bytes]:
    """Talk plaintext: the server's INFO, then what it answers to `send` before closing."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        f = s.makefile("rb")
        info = json.loads(f.readline().removeprefix(b"INFO "))
        s.sendall(send)
        return info, f.read()


@pytest.mark.e2e  # starts nats-server
def test_a_tls_stack_refuses_plaintext_and_other_cas(tls_broker, tmp_path):
    assert tls_broker.nats_url.startswith("tls://")
    port = int(tls_broker.nats_url.rsplit(":", 1)[1])
    admin = tls_broker.nats_options()["options"]
    connect = json.dumps({"user": admin.user, "pass": admin.password, "verbose": True})
    info, reply = _info_and_reply(port, f"CONNECT {connect}\r\nPING\r\n".encode())
    assert info["tls_required"] is True
    assert b"PONG" not in reply and b"+OK" not in reply  # the right password, in the clear

    other = local_tls.generate(tmp_path, "other")
    untrusting = bus.ConnectOptions(admin.user, admin.password, tls_ca=str(other.ca))

    async def attempt(options: bus.ConnectOptions) -> None:
        nc = await nats.connect(
            tls_broker.nats_url,
            allow_reconnect=False,
            max_reconnect_attempts=0,
            connect_timeout=5,
            **options.nats_kwargs(),
        )
        await nc.close()

    with pytest.raises((nats.errors.Error, OSError)):
        asyncio.run(attempt(untrusting))
    asyncio.run(attempt(admin))  # the stack's own CA and the right password get in


@pytest.mark.e2e  # starts nats-server
def test_restarting_nats_keeps_the_certificates(tls_broker):
    ca = Path(tls_broker.nats_tls_ca).read_bytes()
    tls_broker.kill("nats")
    tls_broker.start_nats()
    assert Path(tls_broker.nats_tls_ca).read_bytes() == ca

    async def ping() -> None:
        nc = await bus.connect(tls_broker.nats_url, "t", **tls_broker.nats_options())
        await nc.flush(timeout=5)
        await nc.close()

    asyncio.run(ping())


@pytest.mark.parametrize(("argv", "tls"), [([], True), (["--no-nats-tls"], False)])
def test_skiff_serve_has_tls_on_unless_told(argv, tls, monkeypatch):
    from services.cli import build_serve_parser, stack_config

    monkeypatch.delenv("SKIFF_NATS_TLS", raising=False)
    parser = build_serve_parser()
    args, configs = parser.parse_configs(argv)
    stack = Stack(stack_config(parser, args, configs, "/m"))
    assert stack.config.nats_tls is tls
    assert stack.nats_url.startswith("tls://" if tls else "nats://")


def test_bad_certificates_of_ones_own_fail_in_one_line(tmp_path):
    certs = local_tls.generate(tmp_path)
    other = local_tls.generate(tmp_path, "other")
    (tmp_path / "junk.pem").write_text("not a certificate\n")
    cases = [  # (cert, key, ca), the setting the message names
        (certs.cert, certs.key, tmp_path / "missing.pem", "--nats-tls-ca"),
        (certs.cert, certs.key, tmp_path / "junk.pem", "--nats-tls-ca"),
        (tmp_path / "junk.pem", certs.key, certs.ca, "--nats-server-tls-cert"),
        (certs.cert, other.key, certs.ca, "--nats-server-tls-key"),  # not its key
    ]
    for cert, key, ca, named in cases:
        config = StackConfig(
            RunnerConfig(model_dir=""),
            nats_server_tls_cert=str(cert),
            nats_server_tls_key=str(key),
            nats_tls_ca=str(ca),
        )
        stack = Stack(config)
        with pytest.raises(StartupError, match=named) as e:
            stack.start_nats()
        assert "\n" not in str(e.value) and "nats" not in stack.procs
        stack.stop()


def test_tls_off_is_plaintext():
    stack = Stack(StackConfig(RunnerConfig(model_dir=""), nats_auth=False, nats_tls=False))
    assert stack.nats_url.startswith("nats://")
    assert stack.nats_options()["options"].tls_ca == ""
    with pytest.raises(RuntimeError, match="certificates"):  # on: generated at start
        Stack(StackConfig(RunnerConfig(model_dir=""), nats_auth=False)).nats_options()


# ---- a cluster of real servers -----------------------------------------------------------------


def _wait_port(port: int, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        assert proc.poll() is None, "nats-server exited"
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nats-server did not open {port}")


@pytest.mark.e2e  # starts nats-servers
def test_routes_need_the_ca_and_the_route_password(tmp_path):
    """Four servers; the first two share the CA and the route password and carry a message
    from one's client to the other's; the third, with a wrong password, and the fourth, with
    a certificate of another CA, get nothing through; clients of every server need TLS."""
    certs = local_tls.generate(tmp_path)
    other = local_tls.generate(tmp_path, "other")
    client_ports = [free_port() for _ in range(4)]
    route_ports = [free_port() for _ in range(4)]
    routes = tuple(f"nats://127.0.0.1:{p}" for p in route_ports)
    procs = []
    servers = [(certs, "right"), (certs, "right"), (certs, "wrong"), (other, "right")]
    try:
        for i, (own, password) in enumerate(servers):
            tls = ServerTls(str(own.cert), str(own.key))
            route_tls = ServerTls(str(own.cert), str(own.key), str(own.ca))
            cluster = Cluster(
                "c", routes, listen=f"127.0.0.1:{route_ports[i]}", tls=route_tls, password=password
            )
            conf = tmp_path / f"nats-{i}.conf"
            conf.write_text(server_config(None, "skiff", 1, tls=tls, cluster=cluster))
            argv = [nats_server_binary(), "-a", "127.0.0.1", "-p", str(client_ports[i])]
            log = (tmp_path / f"nats-{i}.log").open("wb")
            procs.append(subprocess.Popen([*argv, "-c", str(conf)], stdout=log, stderr=log))
        for port, proc in zip(client_ports, procs, strict=True):
            _wait_port(port, proc)

        async def run() -> tuple[list[bytes], list[bytes]]:
            ncs = [
                await nats.connect(
                    f"tls://127.0.0.1:{p}",
                    allow_reconnect=False,
                    **bus.ConnectOptions(tls_ca=str(own.ca)).nats_kwargs(),
                )
                for p, (own, _) in zip(client_ports, servers, strict=True)
            ]
            got: list[bytes] = []

            async def on_msg(msg) -> None:
                got.append(msg.data)

            await ncs[0].subscribe("x", cb=on_msg)
            await ncs[0].flush()
            deadline = time.monotonic() + 10  # until the route is up and has the interest
            while not got and time.monotonic() < deadline:
                await ncs[1].publish("x", b"via the route")
                await ncs[1].flush()
                await asyncio.sleep(0.1)
            through = list(got)
            got.clear()
            for _ in range(10):
                for nc in ncs[2:]:
                    await nc.publish("x", b"from a stranger")
                    await nc.flush()
                await asyncio.sleep(0.1)
            for nc in ncs:
                await nc.close()
            return through, got

        through, leaked = asyncio.run(run())
        assert through and set(through) == {b"via the route"}
        assert leaked == []
        log = (tmp_path / "nats-0.log").read_text()
        assert "Authentication Failure" in log  # the wrong password
        assert "certificate signed by unknown authority" in log  # the other CA
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=10)
