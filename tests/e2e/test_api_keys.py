"""API keys as tenants through the real gateway process of a stack with a simulated worker,
with the official openai client: an unknown key is AuthenticationError, a tenant past its
requests per minute is RateLimitError with Retry-After, a model outside its allow-list is
PermissionDeniedError, a stream holds its tenant's only concurrency slot until the client
closes it, /admin/* needs an admin key, and /metrics counts each by tenant name."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from openai import OpenAI

from services.gateway.config import GatewayConfig
from services.gateway.key_file import hash_key
from services.launcher import free_port

MODEL = "SmolLM2-135M-Instruct"
KEYS = {"team-a": "sk-e2e-team-a", "team-b": "sk-e2e-team-b", "ops": "sk-e2e-ops"}
LIMITS = {
    "team-a": {"requests_per_minute": 3},
    "team-b": {"max_concurrency": 1, "models": [MODEL]},
    "ops": {"admin": True, "models": ["another-model"]},
}


@pytest.fixture(scope="module")
def stack(launch_stack, tmp_path_factory):
    path = tmp_path_factory.mktemp("api-keys") / "api-keys.json"
    tenants = [{"name": n, "key_sha256": hash_key(k), **LIMITS[n]} for n, k in KEYS.items()]
    path.write_text(json.dumps({"tenants": tenants}))
    gateway = GatewayConfig(served_model_name=MODEL, port=free_port(), api_keys_file=str(path))
    s = launch_stack("api-keys", device="sim", workers=1, gateway=gateway)
    yield s
    s.stop()


def client(stack, tenant: str) -> OpenAI:
    key = KEYS.get(tenant, tenant)
    return OpenAI(base_url=f"{stack.url}/v1", api_key=key, max_retries=0, timeout=60)


def tenant_metrics(stack) -> dict[tuple[str, str], float]:
    """skiff_gateway_tenant_requests_total by (tenant, outcome), from the gateway's /metrics."""
    out = {}
    for line in httpx.get(f"{stack.url}/metrics").text.splitlines():
        if line.startswith("skiff_gateway_tenant_requests_total{"):
            labels, value = line[line.index("{") + 1 :].split("} ")
            pairs = dict(p.split("=") for p in labels.split(","))
            out[pairs["tenant"].strip('"'), pairs["outcome"].strip('"')] = float(value)
    return out


def test_unknown_keys_are_refused_and_known_ones_served(stack):
    with pytest.raises(openai.AuthenticationError) as e:
        client(stack, "sk-not-a-tenant").completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert e.value.status_code == 401
    out = client(stack, "team-b").completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert out.usage.completion_tokens == 2


def test_requests_per_minute_is_a_rate_limit_error_with_retry_after(stack):
    team_a = client(stack, "team-a")
    for _ in range(3):
        team_a.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
    with pytest.raises(openai.RateLimitError) as e:
        team_a.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert 1 <= int(e.value.response.headers["retry-after"]) <= 20  # one request at 3/min
    assert "requests_per_minute 3" in e.value.message
    client(stack, "team-b").completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    counts = tenant_metrics(stack)
    assert (counts["team-a", "ok"], counts["team-a", "requests_per_minute"]) == (3, 1)
    assert {tenant for tenant, _ in counts} == set(KEYS)  # names only, never keys


def test_a_model_outside_the_allow_list_is_permission_denied(stack):
    ops = client(stack, "ops")
    with pytest.raises(openai.PermissionDeniedError):
        ops.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert ops.models.list().data == []
    assert [m.id for m in client(stack, "team-b").models.list().data] == [MODEL]
    assert tenant_metrics(stack)["ops", "model_not_allowed"] == 1


def test_a_stream_holds_the_concurrency_slot_until_the_client_closes_it(stack):
    team_b = client(stack, "team-b")
    stream = team_b.completions.create(
        model=MODEL, prompt="Hi", max_tokens=1900, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))  # streaming
    with pytest.raises(openai.RateLimitError) as e:
        team_b.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert e.value.response.headers["retry-after"] == "1"
    assert tenant_metrics(stack)["team-b", "max_concurrency"] == 1
    stream.close()  # the client leaves mid-stream
    deadline = time.monotonic() + 10
    while True:
        try:
            team_b.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
            break
        except openai.RateLimitError:
            assert time.monotonic() < deadline, "the slot was not released"
            time.sleep(0.1)


def test_admin_routes_need_an_admin_key(stack):
    url = f"{stack.url}/admin/tenants"
    assert httpx.get(url).status_code == 401
    assert httpx.get(url, headers={"Authorization": f"Bearer {KEYS['team-a']}"}).status_code == 403
    r = httpx.get(url, headers={"Authorization": f"Bearer {KEYS['ops']}"})
    assert r.status_code == 200
    assert {t["name"] for t in r.json()["data"]} == set(KEYS)
    assert "sha256" not in r.text
    assert tenant_metrics(stack)["team-a", "not_admin"] == 1
