"""POST /v1/completions against a scripted engine."""

from __future__ import annotations

import asyncio

import pytest

from tests.gateway.fakes import MODEL, sse_events

# ---- completions ---------------------------------------------------------------------------


@pytest.mark.anyio
async def test_completion_basic_usage_and_request_id(client, engine):
    r = await client.post(
        "/v1/completions",
        headers={"X-Request-Id": "abc-123"},
        json={"model": MODEL, "prompt": "Say hi", "max_tokens": 50},
    )
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == "abc-123"
    body = r.json()
    assert body["id"] == "cmpl-abc-123" and body["object"] == "text_completion"
    choice = body["choices"][0]
    assert choice["text"] == engine.text
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] is None
    prompt_len = len(engine.submitted[0].prompt_token_ids)
    completion = len(engine.tokenizer.encode(engine.text, add_special_tokens=False)) + 1
    assert body["usage"] == {
        "prompt_tokens": prompt_len,
        "completion_tokens": completion,
        "total_tokens": prompt_len + completion,
        "prompt_tokens_details": {"cached_tokens": min(3, prompt_len)},
    }
    r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert len(r.headers["x-request-id"]) == 32
    assert r.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.anyio
async def test_completion_stop_string_aborts_request(client, engine):
    r = await client.post(
        "/v1/completions", json={"prompt": "x", "stop": ["lo wor"], "max_tokens": 50}
    )
    choice = r.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (
        "Hel",
        "stop",
        "lo wor",
    )
    await asyncio.sleep(0.01)
    assert engine.aborted == [engine.submitted[0].req_id]


@pytest.mark.anyio
async def test_completion_stream_holds_back_stop_string(client, engine):
    engine.text = "Hello wonderful world of text"
    r = await client.post(
        "/v1/completions",
        json={
            "prompt": "x",
            "stream": True,
            "stop": "world",
            "max_tokens": 50,
            "include_stop_str_in_output": False,
        },
    )
    assert r.headers["content-type"].startswith("text/event-stream")
    assert "content-length" not in r.headers
    chunks = sse_events(r.text)
    texts = [c["choices"][0]["text"] for c in chunks]
    assert "".join(texts) == "Hello wonderful "
    assert all("wor" not in t for t in texts)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"][0]["stop_reason"] == "world"


@pytest.mark.anyio
async def test_completion_stream_multibyte_and_usage(client, engine):
    engine.text = "日本語 🎉 done"
    r = await client.post(
        "/v1/completions",
        json={
            "prompt": "x",
            "stream": True,
            "max_tokens": 50,
            "stream_options": {"include_usage": True},
        },
    )
    chunks = sse_events(r.text)
    texts = [c["choices"][0]["text"] for c in chunks[:-1]]
    assert "".join(texts) == engine.text
    assert all(t and "\ufffd" not in t for t in texts[:-1])
    assert chunks[-1]["choices"] == []
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == len(engine.tokenizer.encode(engine.text)) + 1
    assert usage["prompt_tokens_details"] == {"cached_tokens": 1}  # clamped to prompt length


@pytest.mark.anyio
async def test_completion_n2_multi_prompt_and_seeds(client, engine):
    r = await client.post(
        "/v1/completions", json={"prompt": ["a", "b c"], "n": 2, "seed": 7, "max_tokens": 3}
    )
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [s.sampling_params.seed for s in engine.submitted] == [7, 8, 7, 8]
    assert len({s.req_id for s in engine.submitted}) == 4
    assert all(s.sampling_params.n == 1 for s in engine.submitted)
    assert body["usage"]["prompt_tokens"] == 1 + 2
    assert body["usage"]["completion_tokens"] == 4 * 3


@pytest.mark.anyio
async def test_completion_echo_token_prompt_and_logprobs(client, engine, tokenizer):
    prompt_ids = tokenizer.encode("Say hi")
    r = await client.post(
        "/v1/completions", json={"prompt": prompt_ids, "echo": True, "logprobs": 2, "max_tokens": 2}
    )
    choice = r.json()["choices"][0]
    assert choice["text"] == "Say hi" + "Hello world"
    lp = choice["logprobs"]
    n = len(prompt_ids) + 2
    assert all(len(lp[k]) == n for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset"))
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["tokens"][len(prompt_ids)] == "Hello"
    assert lp["text_offset"][len(prompt_ids)] == len("Say hi")
    assert lp["top_logprobs"][-1][lp["tokens"][-1]] == -0.5
    assert 2 <= len(lp["top_logprobs"][-1]) <= 3
    assert engine.submitted[0].sampling_params.prompt_logprobs == 2


@pytest.mark.anyio
@pytest.mark.parametrize("prompt", ["hi", ["hi", "hi there"], [5, 6, 7], [[5, 6], [7]]], ids=str)
async def test_completion_prompt_shapes(client, engine, tokenizer, prompt):
    """A text, a list of texts, one list of token ids, or a list of such lists."""
    r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
    assert r.status_code == 200, r.text
    batch = [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else prompt
    expected = [tokenizer.encode(p) if isinstance(p, str) else p for p in batch]
    assert [s.prompt_token_ids for s in engine.submitted] == expected
    assert len(r.json()["choices"]) == len(batch)
