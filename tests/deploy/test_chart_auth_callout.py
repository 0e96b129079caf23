"""nats.authCallout in the chart: no service password in any pod, a projected token with the
NATS audience in every gateway, scheduler and worker pod, the callout Deployment told each
role's service account (the ones those pods run as) and allowed to create TokenReviews, a
nats-server configuration the real nats-server accepts, and the settings it refuses."""

from __future__ import annotations

import subprocess
import sys

import pytest

from services.auth_callout import nats_jwt
from services.launcher import nats_server_binary
from tests.deploy.test_chart_render import (
    HELM,
    KUBERNETES_VERSIONS,
    component,
    find,
    pod_spec,
    render,
    validate_all,
    workloads,
)
from tests.deploy.test_deploy import CHART, ROOT

ON = (
    '{"nats": {"authCallout": {"enabled": true, "signingKeySecret": "callout-key"}}}',
    '{"gateway": {"serviceAccount": {"create": true}}}',
    '{"scheduler": {"serviceAccount": {"create": true}}}',
    '{"worker": {"serviceAccount": {"create": true}}}',
    '{"networkPolicy": {"enabled": true}}',
)
TOKEN_DIR = "/var/run/secrets/skiff/nats"


def _env(container: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def test_every_service_pod_presents_its_own_token_and_holds_no_password():
    docs = render(None, *ON)
    secret = find(docs, "Secret", "skiff-nats-auth")
    assert set(secret["data"]) == {"admin", "auth-callout"}
    pod_name = {"fieldRef": {"fieldPath": "metadata.name"}}
    accounts = {}
    for doc in workloads(docs):
        role = component(doc)
        if role in ("nats", "auth-callout"):
            continue
        pod = pod_spec(doc)
        accounts[role] = pod["serviceAccountName"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert "nats-auth" not in volumes
        (source,) = volumes["nats-token"]["projected"]["sources"]
        assert source["serviceAccountToken"] == {
            "audience": "nats",
            "expirationSeconds": 3600,
            "path": "token",
        }
        (c,) = pod["containers"]
        env = _env(c)
        assert env["SKIFF_NATS_TOKEN_FILE"] == f"{TOKEN_DIR}/token"
        assert env["SKIFF_NATS_USER"] == pod_name and "SKIFF_NATS_PASSWORD_FILE" not in env
        assert ("SKIFF_GATEWAY_ID" in env) == (role == "gateway")
        assert {"name": "nats-token", "mountPath": TOKEN_DIR, "readOnly": True} in c["volumeMounts"]
    assert sorted(accounts) == ["gateway", "scheduler", "worker"]

    callout = find(docs, "Deployment", "skiff-auth-callout")
    pod = pod_spec(callout)
    (c,) = pod["containers"]
    env = _env(c)
    for role, account in accounts.items():
        assert env[f"SKIFF_{role.upper()}_SERVICE_ACCOUNT"] == f"llm/{account}"
    assert c["command"] == ["skiff", "auth-callout"]
    binding = find(docs, "ClusterRoleBinding", "skiff-llm-auth-callout")
    assert binding["roleRef"]["name"] == "system:auth-delegator"
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": pod["serviceAccountName"], "namespace": "llm"}
    ]
    policy = find(docs, "NetworkPolicy", "skiff-nats")
    (expression,) = policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchExpressions"]
    assert "auth-callout" in expression["values"]
    for version in KUBERNETES_VERSIONS:
        validate_all(docs, version)


def test_the_nats_server_accepts_the_rendered_configuration(tmp_path):
    """The init container's command, run here with the Secrets' files, writes a configuration
    that nats-server loads (`-t`)."""
    docs = render(None, *ON, '{"nats": {"tls": {"enabled": false}}}')
    nats = find(docs, "StatefulSet", "skiff-nats")
    (init,) = pod_spec(nats)["initContainers"]
    assert _env(init)["AUTH_CALLOUT_ISSUER"] == {
        "secretKeyRef": {"name": "callout-key", "key": "issuer"}
    }
    issuer = nats_jwt.public_key(nats_jwt.key_pair(nats_jwt.new_account_seed()))
    secrets = tmp_path / "auth"
    secrets.mkdir()
    for user in ("admin", "auth-callout"):
        (secrets / user).write_text("pw")
    argv = [
        a.replace("$(AUTH_CALLOUT_ISSUER)", issuer)
        .replace("/etc/nats/auth", str(secrets))
        .replace("/etc/nats/config", str(tmp_path))
        for a in init["command"]
    ]
    assert argv[:3] == ["python", "-m", "shared.nats_auth"]
    subprocess.run([sys.executable, *argv[1:]], check=True, cwd=ROOT)
    conf = (tmp_path / "nats.conf").read_text()
    assert issuer in conf and '"account": "AUTH"' in conf
    done = subprocess.run(
        [nats_server_binary(), "-t", "-c", str(tmp_path / "nats.conf")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ('{"gateway": {"serviceAccount": {"create": false}}}', "serviceAccount.create"),
        ('{"nats": {"authCallout": {"signingKeySecret": ""}}}', "signingKeySecret"),
        ('{"nats": {"auth": {"enabled": false}}}', "nats.auth.enabled"),
        ('{"worker": {"device": "sim", "sim": {"count": 2}}}', "sim.count"),
        ('{"models": [{"id": "m2", "model": {"source": "embedded"}}]}', "one model"),
    ],
)
def test_settings_the_callout_cannot_serve_are_refused(override, message):
    args = [HELM, "template", "skiff", str(CHART), "-n", "llm"]
    for value in (*ON, override):
        args += ["--set-json", value]
    done = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and message in done.stderr, done.stderr
