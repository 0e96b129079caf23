"""POST /v1/chat/completions against a scripted engine."""

from __future__ import annotations

import pytest

from tests.gateway.fakes import MODEL, sse_events

# ---- chat ----------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_chat_non_stream_with_logprobs(client, engine, tokenizer):
    r = await client.post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "logprobs": True,
            "top_logprobs": 2,
            "max_completion_tokens": 3,
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "Hello world,"}
    assert choice["finish_reason"] == "length"
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == ["Hello", " world", ","]
    assert content[1]["bytes"] == list(b" world")
    assert len(content[0]["top_logprobs"]) == 2
    assert set(content[0]["top_logprobs"][0]) == {"token", "logprob", "bytes"}
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    sent = engine.submitted[0]
    assert sent.prompt_token_ids == tokenizer.encode(rendered, add_special_tokens=False)
    assert sent.sampling_params.logprobs == 2 and sent.sampling_params.max_tokens == 3


@pytest.mark.anyio
async def test_chat_stream_role_first_and_usage(client, engine):
    r = await client.post(
        "/v1/chat/completions",
        json={
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            ],
            "stream": True,
            "n": 2,
            "stream_options": {"include_usage": True},
        },
    )
    chunks = sse_events(r.text)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    for i in range(2):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(m["delta"].get("content", "") for m in mine) == engine.text
        assert mine[-1]["finish_reason"] == "stop"
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == 2 * (len(engine.tokenizer.encode(engine.text)) + 1)
    assert usage["prompt_tokens"] == len(engine.submitted[0].prompt_token_ids)


@pytest.mark.anyio
async def test_stream_engine_failure_becomes_error_event(client, engine):
    engine.fail_after = 2
    r = await client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "stream": True},
    )
    chunks = sse_events(r.text)
    assert chunks[-1]["error"]["code"] == 503
    r = await client.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError"
