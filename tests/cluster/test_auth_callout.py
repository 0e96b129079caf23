"""`skiff auth-callout` against the real API server (the local cluster's kube-apiserver v1.20,
alone: tests/cluster/localkube/api_server.py): service accounts and pods of a namespace of its
own, audience-bound tokens from the TokenRequest API, and the callout process checking them
with the real TokenReview for a real nats-server. A worker's and a gateway's pod-bound
tokens get their own subjects only; a token of another audience, of a deleted service account,
of an account without a role, bound to no pod, forged, or expired (signed with the API
server's own key) is refused."""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import nats
import pytest
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding
from kubernetes import client
from kubernetes.aio.config import new_client_from_config

from services.auth_callout.token_review import token_reviewer
from shared import bus
from tests.auth_callout.broker import callout_broker
from tests.cluster.localkube import api_server

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
AUDIENCE = "nats"


def _pod(core, namespace: str, name: str, account: str) -> client.V1Pod:
    """A pod that never runs (its node does not exist), for tokens bound to it."""
    spec = client.V1PodSpec(
        service_account_name=account,
        node_name="no-such-node",
        automount_service_account_token=False,  # no token controller runs to make its Secret
        containers=[client.V1Container(name="c", image="localhost/none:test")],
    )
    body = client.V1Pod(metadata=client.V1ObjectMeta(name=name), spec=spec)
    return core.create_namespaced_pod(namespace, body)


def _token(core, namespace: str, account: str, pod=None, audience: str = AUDIENCE) -> str:
    bound = None
    if pod is not None:
        bound = client.V1BoundObjectReference(
            api_version="v1", kind="Pod", name=pod.metadata.name, uid=pod.metadata.uid
        )
    spec = client.V1TokenRequestSpec(
        audiences=[audience], expiration_seconds=3600, bound_object_ref=bound
    )
    request = client.AuthenticationV1TokenRequest(spec=spec)
    return core.create_namespaced_service_account_token(account, namespace, request).status.token


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _resigned(server, token: str, shift_s: int) -> str:
    """`token` with its times moved by `shift_s`, signed again with the API server's own
    service-account key: a token the API server itself could have issued."""
    head, body, _ = token.split(".")
    claims = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    for name in ("iat", "nbf", "exp"):
        claims[name] += shift_s
    signed = f"{head}.{_b64(json.dumps(claims).encode())}"
    key = serialization.load_pem_private_key((server.pki.dir / "sa.key").read_bytes(), None)
    signature = key.sign(signed.encode(), padding.PKCS1v15(), hashes.SHA256())  # RS256
    return f"{signed}.{_b64(signature)}"


@pytest.fixture(scope="module")
def server():
    with api_server.running() as server:
        yield server


@pytest.fixture(scope="module")
def accounts(server):
    """(namespace, tokens by case) in a namespace deleted afterwards."""
    core = client.CoreV1Api(server.api())
    namespace = f"callout-test-{uuid.uuid4().hex[:6]}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace)))
    try:
        for account in ("skiff-gateway", "skiff-worker", "stranger", "gone"):
            meta = client.V1ObjectMeta(name=account)
            core.create_namespaced_service_account(
                namespace, client.V1ServiceAccount(metadata=meta)
            )
        worker = _pod(core, namespace, "skiff-worker-0", "skiff-worker")
        gateway = _pod(core, namespace, "skiff-gateway-a", "skiff-gateway")
        stranger = _pod(core, namespace, "stranger-0", "stranger")
        gone = _pod(core, namespace, "gone-0", "gone")
        tokens = {
            "worker": _token(core, namespace, "skiff-worker", worker),
            "gateway": _token(core, namespace, "skiff-gateway", gateway),
            "other-audience": _token(core, namespace, "skiff-worker", worker, "other"),
            "no-role": _token(core, namespace, "stranger", stranger),
            "no-pod": _token(core, namespace, "skiff-worker"),
            "deleted-account": _token(core, namespace, "gone", gone),
        }
        core.delete_namespaced_service_account("gone", namespace)
        head, body, signature = tokens["worker"].split(".")
        tokens["forged"] = f"{head}.{body}.{signature[::-1]}"
        tokens["expired"] = _resigned(server, tokens["worker"], -2 * 3600)  # an hour ago
        tokens["resigned"] = _resigned(server, tokens["worker"], 0)  # the control
        yield namespace, tokens
    finally:
        core.delete_namespace(namespace)


@pytest.fixture(scope="module")
def broker(server, accounts, tmp_path_factory):
    """A nats-server behind the real `skiff auth-callout` process."""
    namespace, _ = accounts
    tmp = tmp_path_factory.mktemp("callout")
    with callout_broker(tmp) as broker:
        password = tmp / "callout-password"
        password.write_text(broker.callout_password)
        cmd = [
            sys.executable, "-m", "services.cli", "auth-callout",
            "--nats-url", broker.url, "--nats-password-file", str(password),
            "--signing-key-file", str(broker.seed_file), "--kubeconfig", str(server.kubeconfig),
            "--gateway-service-account", f"{namespace}/skiff-gateway",
            "--worker-service-account", f"{namespace}/skiff-worker,{namespace}/gone",
        ]  # fmt: skip
        log = tmp / "callout.log"
        with log.open("w") as out:
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 30
            while "answering" not in log.read_text():
                assert proc.poll() is None, log.read_text()
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
            yield broker
        finally:
            proc.terminate()
            proc.wait(10)


def test_pod_tokens_get_their_own_subjects(broker, accounts, tmp_path):
    _, tokens = accounts

    async def run() -> None:
        errors: list[str] = []

        async def on_error(e: Exception) -> None:
            errors.append(str(e))

        clients = []
        for role, pod in (("worker", "skiff-worker-0"), ("gateway", "skiff-gateway-a")):
            path = tmp_path / role
            path.write_text(tokens[role])
            options = bus.ConnectOptions(user=pod, token_file=str(path))
            clients.append(
                await nats.connect(broker.url, error_cb=on_error, **options.nats_kwargs())
            )
        worker, gateway = clients
        admin = await broker.admin()
        got: list[str] = []

        async def on_msg(msg) -> None:
            got.append(msg.subject)

        for subject in ("skiff.worker.skiff-worker-0.plan", "skiff.worker.skiff-worker-1.plan"):
            await worker.subscribe(subject, cb=on_msg)
        for subject in ("skiff.out.skiff-gateway-a", "skiff.out.skiff-gateway-b"):
            await gateway.subscribe(subject, cb=on_msg)
        for nc in clients:
            await bus.flush(nc)
        for subject in (
            "skiff.worker.skiff-worker-0.plan",
            "skiff.worker.skiff-worker-1.plan",
            "skiff.out.skiff-gateway-a",
            "skiff.out.skiff-gateway-b",
        ):
            await admin.publish(subject, b"m")
        await admin.flush()
        await asyncio.sleep(0.3)
        assert sorted(got) == ["skiff.out.skiff-gateway-a", "skiff.worker.skiff-worker-0.plan"]
        assert sorted(e for e in errors if "permissions violation" in e) == [
            'nats: permissions violation for subscription to "skiff.out.skiff-gateway-b"',
            'nats: permissions violation for subscription to "skiff.worker.skiff-worker-1.plan"',
        ]
        for nc in (*clients, admin):
            await nc.close()

    asyncio.run(run())


def test_a_reviewed_token_carries_its_expiry_which_bounds_its_nats_user(server, accounts):
    _, tokens = accounts
    body = tokens["worker"].split(".")[1]
    exp = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))["exp"]

    async def run() -> int:
        api = await new_client_from_config(str(server.kubeconfig))
        try:
            return (await token_reviewer(api, AUDIENCE)(tokens["worker"])).expires_at
        finally:
            await api.close()

    assert asyncio.run(run()) == exp
    assert exp > time.time() + 3000  # the TokenRequest's hour


def test_a_token_signed_again_with_the_api_servers_key_is_admitted(broker, accounts):
    """The control of the expired case: signing again alone does not get a token refused."""
    _, tokens = accounts

    async def run() -> None:
        nc = await nats.connect(
            broker.url, token=tokens["resigned"], allow_reconnect=False, connect_timeout=10
        )
        await nc.close()

    asyncio.run(run())


@pytest.mark.parametrize(
    "case", ["other-audience", "deleted-account", "no-role", "no-pod", "forged", "expired"]
)
def test_refused_tokens(broker, accounts, case):
    _, tokens = accounts

    async def run() -> None:
        with pytest.raises(nats.errors.Error, match="Authorization Violation"):
            await nats.connect(
                broker.url, token=tokens[case], allow_reconnect=False, connect_timeout=10
            )

    asyncio.run(run())
