"""/tokenize, /detokenize, /v1/models, /health, /version and /metrics."""

from __future__ import annotations

import pytest

from tests.gateway.fakes import MAX_MODEL_LEN, MODEL

# ---- tokenize / models / health / metrics --------------------------------------------------


@pytest.mark.anyio
async def test_tokenize_detokenize(client, tokenizer):
    r = await client.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True})
    body = r.json()
    assert body["tokens"] == tokenizer.encode("Hello world")
    assert body["count"] == 2 and body["max_model_len"] == MAX_MODEL_LEN
    assert body["token_strs"] == ["Hello", " world"]
    r = await client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.json()["count"] > 5
    r = await client.post("/detokenize", json={"tokens": body["tokens"]})
    assert r.json() == {"prompt": "Hello world"}


@pytest.mark.anyio
async def test_models_health_version_metrics(client, engine):
    models = (await client.get("/v1/models")).json()
    assert models["data"][0]["id"] == MODEL
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert (await client.get("/health")).status_code == 200
    engine.ready = False
    r = await client.get("/health")
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    engine.ready = True
    assert "version" in (await client.get("/version")).json()
    await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    text = (await client.get("/metrics")).text
    for name in (
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:e2e_request_latency_seconds",
        'vllm:request_success_total{finished_reason="length",model_name="' + MODEL,
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "skiff_gateway_http_requests_total",
        'skiff_gateway_engine_ready{model_name="' + MODEL + '"} 1.0',
    ):
        assert name in text, name
