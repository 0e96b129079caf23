"""The chart's API keys as tenants, rendered by a real helm: gateway.apiKeys.tenants become a
Secret holding the key file (hashes, never keys) that the gateway loads as it is, mounted at
SKIFF_API_KEYS_FILE, with a checksum that rolls the gateways when it changes; an existing
Secret is mounted instead; the schema refuses a key in clear, and both sources at once fail."""

from __future__ import annotations

import base64
import json

from services.gateway.key_file import hash_key, tenants_of
from tests.deploy.test_chart_kube_versions import render_error
from tests.deploy.test_chart_render import KUBERNETES_VERSIONS, find, render, validate_all
from tests.deploy.test_deploy import env_vars_read_by

TENANTS = [
    {
        "name": "team-a",
        "key_sha256": hash_key("sk-team-a"),
        "requests_per_minute": 600,
        "tokens_per_minute": 200000,
        "max_concurrency": 8,
        "models": ["SmolLM2-135M-Instruct"],
    },
    {"name": "ops", "key_sha256": hash_key("sk-ops"), "admin": True},
]


def tenants_values(tenants: list[dict]) -> str:
    return json.dumps({"gateway": {"apiKeys": {"tenants": tenants}}})


def gateway(docs) -> tuple[dict, dict]:
    """The gateway's pod template and its container."""
    template = find(docs, "Deployment", "skiff-gateway")["spec"]["template"]
    (container,) = template["spec"]["containers"]
    return template, container


def key_file_env(container: dict) -> str | None:
    return next((e["value"] for e in container["env"] if e["name"] == "SKIFF_API_KEYS_FILE"), None)


def mounted_secret(docs) -> tuple[str, str]:
    """The Secret mounted as the key file, and the file's path in the container."""
    template, container = gateway(docs)
    (volume,) = [v for v in template["spec"]["volumes"] if v["name"] == "api-keys"]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "api-keys"]
    (item,) = volume["secret"]["items"]
    assert mount["readOnly"] is True
    return volume["secret"]["secretName"], f"{mount['mountPath']}/{item['path']}"


def test_inline_tenants_become_a_key_file_secret_the_gateway_loads(tmp_path):
    docs = render(None, tenants_values(TENANTS))
    secret = find(docs, "Secret", "skiff-api-keys")
    text = base64.b64decode(secret["data"]["api-keys.json"]).decode()
    assert "sk-team-a" not in text and hash_key("sk-team-a") in text
    path = tmp_path / "api-keys.json"
    path.write_text(text)
    team_a, ops = tenants_of(None, str(path))
    assert team_a.model_dump(exclude_none=True) == {
        **TENANTS[0],
        "models": ("SmolLM2-135M-Instruct",),
        "admin": False,
    }
    assert (ops.name, ops.admin, ops.max_concurrency) == ("ops", True, None)

    name, file = mounted_secret(docs)
    assert name == "skiff-api-keys"
    assert key_file_env(gateway(docs)[1]) == file == "/etc/skiff/api-keys/api-keys.json"
    assert "SKIFF_API_KEYS_FILE" in env_vars_read_by("gateway")
    for version in KUBERNETES_VERSIONS:
        assert validate_all(docs, version) > 0


def test_a_changed_key_file_rolls_the_gateways():
    def checksum(tenants: list[dict]) -> str:
        template, _ = gateway(render(None, tenants_values(tenants)))
        return template["metadata"]["annotations"]["checksum/api-keys"]

    assert checksum(TENANTS) == checksum(TENANTS)
    assert checksum(TENANTS) != checksum(TENANTS[:1])
    template, _ = gateway(render(None))
    assert "checksum/api-keys" not in template["metadata"].get("annotations", {})


def test_an_existing_secret_is_mounted_instead():
    values = '{"gateway":{"apiKeys":{"existingSecret":"llm-keys","key":"tenants.json"}}}'
    docs = render(None, values)
    assert mounted_secret(docs) == ("llm-keys", "/etc/skiff/api-keys/tenants.json")
    assert key_file_env(gateway(docs)[1]) == "/etc/skiff/api-keys/tenants.json"
    assert not [d for d in docs if d["kind"] == "Secret" and "api-keys" in d["metadata"]["name"]]


def test_without_api_keys_nothing_is_mounted():
    _, container = gateway(render(None))
    assert key_file_env(container) is None
    assert not [m for m in container["volumeMounts"] if m["name"] == "api-keys"]


def test_the_schema_refuses_keys_in_clear_and_both_sources_fail():
    plain = tenants_values([{"name": "team-a", "key": "sk-team-a"}])
    assert "key_sha256" in render_error(None, plain)
    short = tenants_values([{"name": "team-a", "key_sha256": "abc"}])
    assert "key_sha256" in render_error(None, short)
    both = json.dumps({"gateway": {"apiKeys": {"existingSecret": "x", "tenants": TENANTS}}})
    assert "set existingSecret or tenants, not both" in render_error(None, both)
