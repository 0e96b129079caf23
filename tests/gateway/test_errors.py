"""Bad input gets an OpenAI-style error, never a 500."""

from __future__ import annotations

import httpx
import pytest

from services.gateway.app import create_app
from services.gateway.engine_client import EngineError
from tests.gateway.fakes import CHAT, MSG, C, gateway_config, make_client

# ---- errors --------------------------------------------------------------------------------

BAD_REQUESTS = [
    (CHAT, {"messages": MSG, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    (CHAT, {"messages": MSG, "max_tokens": 0}, 400, "max_tokens"),
    (CHAT, {"messages": MSG, "max_completion_tokens": 10**6}, 400, "max_completion_tokens"),
    (C, {"prompt": "x", "temperature": 3}, 400, "temperature"),
    (C, {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    (C, {"prompt": "x", "top_p": 0}, 400, "top_p"),
    (C, {"prompt": "x", "top_k": -2}, 400, "top_k"),
    (C, {"prompt": "x", "min_p": 1.5}, 400, "min_p"),
    (C, {"prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
    (C, {"prompt": "x", "frequency_penalty": -3}, 400, "frequency_penalty"),
    (C, {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    (C, {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    (C, {"prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    (C, {"prompt": "x", "logit_bias": {"999999": 1}}, 400, "logit_bias"),
    (C, {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    (C, {"prompt": [1, 99999999]}, 400, "prompt"),
    (C, {"prompt": [[1, 2], [-1]]}, 400, "prompt"),
    (C, {"prompt": [2**70]}, 400, "prompt"),
    (C, {"prompt": []}, 400, "prompt"),
    (C, {"prompt": ""}, 400, "prompt"),
    (C, {"prompt": 5}, 400, "prompt"),
    (C, {}, 400, "prompt"),
    (C, {"prompt": "x", "stop_token_ids": [49152]}, 400, "stop_token_ids"),
    (C, {"prompt": "x", "allowed_token_ids": []}, 400, "allowed_token_ids"),
    (C, {"prompt": "x", "n": 2, "temperature": 0}, 400, "n"),
    (C, {"prompt": "x", "n": 0}, 400, "n"),
    (C, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    (C, {"prompt": "x", "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens"),
    (C, {"prompt": "x", "seed": 2**64}, 400, "seed"),
    (C, {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    (C, {"prompt": "x", "max_tokens": 256}, 400, "max_tokens"),
    (C, {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": [{"content": "hi"}]}, 400, "messages.0.role"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, None),
    (CHAT, {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs"),
    (CHAT, {"messages": MSG, "top_logprobs": 21, "logprobs": True}, 400, "top_logprobs"),
    (CHAT, {"messages": MSG, "max_tokens": 10**9}, 400, "max_tokens"),
    (CHAT, {"messages": MSG, "continue_final_message": True}, 400, "continue_final_message"),
    ("/detokenize", {"tokens": [49152]}, 400, "tokens"),
    ("/tokenize", {"prompt": 1}, 400, None),
]


@pytest.mark.anyio
@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_REQUESTS)
async def test_bad_requests(client, engine, path, body, status, param):
    r = await client.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status
    if param is not None:
        assert error["param"] == param, error
    assert not engine.submitted


@pytest.mark.anyio
async def test_context_length_message_uses_vllm_wording(client):
    r = await client.post(C, json={"prompt": "x", "max_tokens": 256})
    assert r.json()["error"]["message"] == (
        "This model's maximum context length is 256 tokens. However, you requested 257 tokens "
        "(1 in the messages, 256 in the completion). Please reduce the length of the messages "
        "or completion."
    )


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("content", "content_type", "status"),
    [
        (b"{not json", "application/json", 400),
        (b'{"prompt": "\xff\xfe"}', "application/json", 400),
        (b'{"prompt": "x", "temperature": NaN}', "application/json", 400),
        (b"[" * 100_000 + b"]" * 100_000, "application/json", 400),
        (b'"just a string"', "application/json", 400),
        (b"prompt=x", "application/x-www-form-urlencoded", 400),
        (b'{"prompt": "x", "stop": "\\ud800"}', "application/json", 400),
        (b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "application/json", 400),
    ],
)
async def test_malformed_bodies(client, content, content_type, status):
    r = await client.post(C, content=content, headers={"content-type": content_type})
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == status


@pytest.mark.anyio
async def test_routing_size_and_engine_errors(engine, tokenizer):
    async with make_client(engine, tokenizer, max_body_bytes=1000) as client:
        r = await client.get("/v1/nope")
        assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
        r = await client.get(C)
        assert r.status_code == 405 and r.json()["error"]["code"] == 405
        r = await client.post(C, json={"prompt": "x" * 2000})
        assert r.status_code == 413 and r.json()["error"]["code"] == 413
        engine.reject = EngineError(429, "the scheduler queue is full")
        r = await client.post(C, json={"prompt": "x"})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["message"] == "the scheduler queue is full"
        engine.reject = EngineError(503, "no scheduler")
        r = await client.post(CHAT, json={"messages": MSG, "stream": True})
        assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError"


@pytest.mark.anyio
async def test_unknown_context_length_is_503(engine, tokenizer):
    engine.max_model_len = None
    app = create_app(engine, tokenizer, gateway_config(max_model_len=None))
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://test"
    ) as client:
        r = await client.post(C, json={"prompt": "x"})
        assert r.status_code == 503
        engine.max_model_len = 100
        r = await client.post(C, json={"prompt": "x", "max_tokens": 100})
        assert "maximum context length is 100 tokens" in r.json()["error"]["message"]


@pytest.mark.anyio
async def test_draining_refuses_new_work(engine, tokenizer):
    app = create_app(engine, tokenizer, gateway_config())
    app.state.gateway.draining = True
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://test"
    ) as client:
        assert (await client.get("/health")).status_code == 503
        r = await client.post(CHAT, json={"messages": MSG})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"


@pytest.mark.anyio
async def test_api_key(engine, tokenizer):
    async with make_client(engine, tokenizer, api_key="s3cret") as client:
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": "s3cret"},
            {"Authorization": "Bearer s3cret\u00e9".encode("latin-1")},
        ):
            r = await client.post(C, json={"prompt": "x"}, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == 401
        assert (await client.get("/v1/nope")).status_code == 401
        ok = {"Authorization": "Bearer s3cret"}
        assert (await client.post(C, json={"prompt": "x"}, headers=ok)).status_code == 200
        assert (await client.get("/v1/models", headers=ok)).status_code == 200
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/metrics")).status_code == 200
