"""API keys as tenants: the key file, 401/403/429 with Retry-After, token and request buckets,
concurrency held for a stream's whole life, the constant-time key comparison, the admin route
and the per-tenant metrics."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import io
import json
import math
import time

import httpx
import pytest

from services.gateway.app import create_app
from services.gateway.config import GatewayConfig
from services.gateway.key_file import KeyFileError, hash_key, hash_key_main, tenants_of
from services.gateway.main import serve
from tests.gateway.fakes import CHAT, MODEL, MSG, C, FakeEngine, gateway_config, sse_events

KEYS = {"a": "sk-team-a", "b": "sk-team-b", "ops": "sk-ops"}


def key_file(tmp_path, **tenants: dict) -> str:
    """A key file of `tenants` (name: extra fields), each with its key from KEYS hashed."""
    entries = [{"name": n, "key_sha256": hash_key(KEYS[n]), **f} for n, f in tenants.items()]
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"tenants": entries}))
    return str(path)


def auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[name]}"}


class Clock:
    """Real monotonic time plus what a test skips ahead."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset


def make(engine, tokenizer, path: str, **config):
    app = create_app(engine, tokenizer, gateway_config(api_keys_file=path, **config))
    clock = Clock()
    app.state.tenants.clock = clock
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
    return app, client, clock


def sample(app, name: str, **labels: str) -> float | None:
    return app.state.gateway.metrics.registry.get_sample_value(name, labels)


def outcomes(app, tenant: str) -> dict[str, float]:
    registry = app.state.gateway.metrics.registry
    return {
        s.labels["outcome"]: s.value
        for metric in registry.collect()
        if metric.name == "skiff_gateway_tenant_requests"
        for s in metric.samples
        if s.name.endswith("_total") and s.labels["tenant"] == tenant and s.value
    }


# ---- the key file ---------------------------------------------------------------------------


def test_key_file_loads_tenants_and_the_single_api_key_is_the_default_admin(tmp_path):
    path = key_file(tmp_path, a={"requests_per_minute": 5, "models": [MODEL]}, ops={"admin": True})
    a, ops, default = tenants_of("legacy", path)
    assert (a.name, a.requests_per_minute, a.models, a.admin) == ("a", 5, (MODEL,), False)
    assert ops.admin and ops.tokens_per_minute is None
    assert (default.name, default.admin, default.key_sha256) == (
        "default",
        True,
        hash_key("legacy"),
    )
    assert tenants_of(None, None) == []


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (None, "cannot read it (No such file or directory)"),
        ("tenants: []", "not valid JSON"),
        ('{"tenants": []}', "tenants: List should have at least 1 item"),
        ('{"tenant": []}', "tenants: Field required"),
        ('{"tenants": [{"name": "a", "key": "sk-plain"}]}', "tenants.0.key_sha256: Field required"),
        (
            '{"tenants": [{"name": "a", "key_sha256": "sk-plain"}]}',
            "tenants.0.key_sha256: String should match pattern",
        ),
        (
            '{"tenants": [{"name": "a b", "key_sha256": "' + "a" * 64 + '"}]}',
            "tenants.0.name: String should match pattern",
        ),
        (
            '{"tenants": [{"name": "a", "key_sha256": "' + "a" * 64 + '", "rpm": 3}]}',
            "tenants.0.rpm: Extra inputs are not permitted",
        ),
        (
            '{"tenants": [{"name": "a", "key_sha256": "' + "a" * 64 + '", "max_concurrency": 0}]}',
            "tenants.0.max_concurrency: Input should be greater than or equal to 1",
        ),
        (
            '{"tenants": [{"name": "a", "key_sha256": "' + "a" * 64 + '"}, '
            '{"name": "a", "key_sha256": "' + "b" * 64 + '"}]}',
            "tenant name 'a' is used twice",
        ),
        (
            '{"tenants": [{"name": "a", "key_sha256": "' + "a" * 64 + '"}, '
            '{"name": "b", "key_sha256": "' + "A" * 64 + '"}]}',
            "tenant 'b' has the key of another tenant",
        ),
    ],
)
def test_a_bad_key_file_is_one_line_naming_what_to_fix(tmp_path, content, says):
    path = tmp_path / "keys.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(KeyFileError) as e:
        tenants_of(None, str(path))
    assert says in str(e.value) and str(path) in str(e.value) and "\n" not in str(e.value)


def test_the_gateway_exits_at_start_on_a_bad_key_file(tmp_path):
    """Before waiting for the tokenizer or connecting to NATS."""
    path = tmp_path / "keys.json"
    path.write_text('{"tenants": [{"name": "a", "key_sha256": "x"}]}')
    config = GatewayConfig(api_keys_file=str(path), model_dir=str(tmp_path / "no-model"))
    with pytest.raises(SystemExit) as e:
        asyncio.run(serve(config))
    assert str(e.value).startswith(f"skiff gateway: API key file {path}: tenants.0.key_sha256")


def test_skiff_hash_key_prints_the_sha256_of_the_key_on_stdin(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("sk-team-a\n"))
    assert hash_key_main([]) == 0
    assert capsys.readouterr().out == hashlib.sha256(b"sk-team-a").hexdigest() + "\n"
    assert hash_key_main(["sk-on-the-command-line"]) == 2  # keys stay out of shell history


# ---- authentication -------------------------------------------------------------------------


@pytest.mark.anyio
async def test_unknown_keys_are_401_and_each_tenant_is_recognised(engine, tokenizer, tmp_path):
    app, client, _ = make(engine, tokenizer, key_file(tmp_path, a={}, b={}))
    async with client:
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": KEYS["a"]}):
            r = await client.post(C, json={"prompt": "x"}, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
            assert r.headers["www-authenticate"] == "Bearer"
        for name in ("a", "b"):
            assert (await client.post(C, json={"prompt": "x"}, headers=auth(name))).is_success
            assert outcomes(app, name) == {"ok": 1}
        assert (await client.get("/health")).status_code == 200  # probes need no key


@pytest.mark.anyio
async def test_keys_are_compared_in_constant_time_against_every_tenant(
    engine, tokenizer, tmp_path, monkeypatch
):
    """compare_digest over the presented key's SHA-256, once per stored hash, whichever tenant
    (or none) matches: no early exit tells which."""
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    _, client, _ = make(engine, tokenizer, key_file(tmp_path, a={}, b={}, ops={}))
    async with client:
        for name in ("a", "ops", "b"):  # the first, last and middle tenant
            calls.clear()
            assert (await client.get("/v1/models", headers=auth(name))).status_code == 200
            assert len(calls) == 3
            assert calls[0][0] == hashlib.sha256(KEYS[name].encode()).digest()
        calls.clear()
        r = await client.get("/v1/models", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and len(calls) == 3
        assert all(len(a) == len(b) == 32 for a, b in calls)


# ---- limits ---------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_requests_per_minute_429_with_retry_after_then_refill(engine, tokenizer, tmp_path):
    app, client, clock = make(
        engine, tokenizer, key_file(tmp_path, a={"requests_per_minute": 2}, b={})
    )
    async with client:
        for _ in range(2):
            assert (await client.post(C, json={"prompt": "x"}, headers=auth("a"))).is_success
        r = await client.post(C, json={"prompt": "x"}, headers=auth("a"))
        assert r.status_code == 429 and r.headers["retry-after"] == "30"  # 1 unit at 2/min
        assert r.json()["error"]["type"] == "RateLimitError"
        assert "requests_per_minute 2" in r.json()["error"]["message"]
        assert (await client.post(C, json={"prompt": "x"}, headers=auth("b"))).is_success
        clock.offset += 29
        assert (await client.post(C, json={"prompt": "x"}, headers=auth("a"))).status_code == 429
        clock.offset += 1.5
        assert (await client.post(C, json={"prompt": "x"}, headers=auth("a"))).is_success
        assert outcomes(app, "a") == {"ok": 3, "requests_per_minute": 2}
        assert len(engine.submitted) == 4  # the refused ones never reached the engine


@pytest.mark.anyio
async def test_tokens_per_minute_counts_prompt_and_generated_tokens(engine, tokenizer, tmp_path):
    app, client, clock = make(engine, tokenizer, key_file(tmp_path, a={"tokens_per_minute": 5}))
    async with client:
        body = {"prompt": "x", "stream": True, "stream_options": {"include_usage": True}}
        r = await client.post(C, json=body, headers=auth("a"))
        assert r.is_success  # admitted with 5 tokens left; it uses more
        usage = sse_events(r.text)[-1]["usage"]
        assert usage["completion_tokens"] > 5  # the scripted text and EOS
        r = await client.post(C, json={"prompt": "x"}, headers=auth("a"))
        assert r.status_code == 429 and "tokens_per_minute 5" in r.json()["error"]["message"]
        counted = {
            kind: sample(app, "skiff_gateway_tenant_tokens_total", tenant="a", kind=kind)
            for kind in ("prompt", "generation")
        }
        assert counted == {
            "prompt": usage["prompt_tokens"],
            "generation": usage["completion_tokens"],
        }
        debt = usage["total_tokens"] - 5  # below zero; one unit needed, 5/60 per second
        assert r.headers["retry-after"] == str(math.ceil((debt + 1) * 12))
        clock.offset += 60
        assert (await client.post(C, json={"prompt": "x"}, headers=auth("a"))).is_success


@pytest.mark.anyio
async def test_model_allow_list_is_403_and_filters_the_model_list(engine, tokenizer, tmp_path):
    path = key_file(tmp_path, a={"models": ["another-model"]}, b={"models": [MODEL]})
    app, client, _ = make(engine, tokenizer, path)
    async with client:
        for body in ({"prompt": "x"}, {"prompt": "x", "model": MODEL}):
            r = await client.post(C, json=body, headers=auth("a"))
            assert r.status_code == 403 and r.json()["error"]["type"] == "PermissionDeniedError"
            assert r.json()["error"]["param"] == "model"
        r = await client.post(CHAT, json={"messages": MSG}, headers=auth("a"))
        assert r.status_code == 403
        assert (await client.get("/v1/models", headers=auth("a"))).json()["data"] == []
        assert (await client.get("/v1/models", headers=auth("b"))).json()["data"][0]["id"] == MODEL
        assert (await client.post(C, json={"prompt": "x"}, headers=auth("b"))).is_success
        assert outcomes(app, "a") == {"model_not_allowed": 3, "ok": 1}
        assert not engine.submitted[1:]


async def _stream_and_disconnect(app, headers: dict[str, str]):
    """A streamed completion driven over ASGI; it disconnects when `disconnect` is set."""
    sent: list[dict] = []
    disconnect, started = asyncio.Event(), asyncio.Event()
    body = json.dumps({"prompt": "x", "stream": True, "max_tokens": 100}).encode()
    requested = False

    async def receive() -> dict:
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": body, "more_body": False}
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)
        if len(sent) >= 3:
            started.set()

    raw = [(b"content-type", b"application/json"), (b"host", b"test")]
    raw += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": C,
        "raw_path": C.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": raw,
        "client": ("127.0.0.1", 1),
        "server": ("test", 80),
    }
    task = asyncio.create_task(app(scope, receive, send))
    await asyncio.wait_for(started.wait(), 5)
    return task, disconnect, sent


@pytest.mark.anyio
async def test_concurrency_is_held_for_a_whole_stream_and_released_on_disconnect(
    tokenizer, tmp_path
):
    engine = FakeEngine(tokenizer, text="one two three four five six seven eight " * 5, delay=0.02)
    app, client, _ = make(engine, tokenizer, key_file(tmp_path, a={"max_concurrency": 1}))
    async with client:
        task, disconnect, sent = await _stream_and_disconnect(app, auth("a"))
        assert sent[0]["status"] == 200
        assert sample(app, "skiff_gateway_tenant_requests_in_flight", tenant="a") == 1
        r = await client.post(C, json={"prompt": "x"}, headers=auth("a"))
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert "max_concurrency 1" in r.json()["error"]["message"]
        disconnect.set()  # the client leaves mid-stream
        await asyncio.wait_for(task, 5)
        assert not any(m.get("more_body") is False for m in sent[1:])  # it was cut short
        assert sample(app, "skiff_gateway_tenant_requests_in_flight", tenant="a") == 0
        assert app.state.tenants.states[0].in_flight == 0
        assert (await client.post(C, json={"prompt": "x"}, headers=auth("a"))).is_success
        assert outcomes(app, "a") == {"ok": 2, "max_concurrency": 1}


@pytest.mark.anyio
async def test_concurrency_is_released_when_the_request_task_is_cancelled(tokenizer, tmp_path):
    engine = FakeEngine(tokenizer, text="one two three " * 20, delay=0.02)
    app, client, _ = make(engine, tokenizer, key_file(tmp_path, a={"max_concurrency": 1}))
    task, _, _ = await _stream_and_disconnect(app, auth("a"))
    task.cancel()  # the server goes away mid-stream
    with pytest.raises(asyncio.CancelledError):
        await task
    assert app.state.tenants.states[0].in_flight == 0
    assert sample(app, "skiff_gateway_tenant_requests_in_flight", tenant="a") == 0
    await client.aclose()


# ---- admin route and metrics ----------------------------------------------------------------


@pytest.mark.anyio
async def test_admin_route_needs_an_admin_tenant(engine, tokenizer, tmp_path):
    path = key_file(tmp_path, a={"requests_per_minute": 10, "models": [MODEL]}, ops={"admin": True})
    app, client, _ = make(engine, tokenizer, path, api_key="legacy")
    async with client:
        assert (await client.get("/admin/tenants")).status_code == 401
        r = await client.get("/admin/tenants", headers=auth("a"))
        assert r.status_code == 403 and r.json()["error"]["type"] == "PermissionDeniedError"
        r = await client.get("/admin/tenants", headers=auth("ops"))
        assert r.status_code == 200
        tenants = {t["name"]: t for t in r.json()["data"]}
        assert set(tenants) == {"a", "ops", "default"}
        assert tenants["a"]["requests_per_minute"] == 10 and tenants["a"]["models"] == [MODEL]
        assert tenants["ops"]["in_flight"] == 1  # this very request
        assert "sha256" not in r.text and "key" not in json.dumps(list(tenants["a"]))
        r = await client.get("/admin/tenants", headers={"Authorization": "Bearer legacy"})
        assert r.status_code == 200  # --api-key is an admin
        assert outcomes(app, "a") == {"not_admin": 1}


@pytest.mark.anyio
async def test_without_keys_requests_are_the_anonymous_tenant(engine, tokenizer):
    """No key needed; usage is still counted, and every tenant series exists at zero."""
    app = create_app(engine, tokenizer, gateway_config())
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://test"
    ) as client:
        assert (await client.post(C, json={"prompt": "x"})).is_success
        assert (await client.post(C, json={"prompt": "x", "max_tokens": -1})).status_code == 400
        assert (await client.get("/admin/tenants")).json()["data"][0]["name"] == "anonymous"
    assert outcomes(app, "anonymous") == {"ok": 2, "error": 1}
    assert sample(app, "skiff_gateway_tenant_tokens_total", tenant="anonymous", kind="prompt") > 0
    for outcome in ("requests_per_minute", "tokens_per_minute", "max_concurrency"):
        assert (
            sample(app, "skiff_gateway_tenant_requests_total", tenant="anonymous", outcome=outcome)
            == 0
        )
