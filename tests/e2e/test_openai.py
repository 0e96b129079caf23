"""The official `openai` client against the real stack: nats-server, scheduler, worker and
gateway as separate processes (session fixture `stack`)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from openai import OpenAI

from bench.workload import QUESTIONS, token_prompts
from services.offline import SamplingParams
from shared.tokenizer import Tokenizer
from tests.e2e.stats import scheduler_stats

MODEL = "SmolLM2-135M-Instruct"


def wait_idle(stack, timeout_s: float = 60) -> dict:
    """Until the scheduler holds no request and every block is free again."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = scheduler_stats(stack)
        worker = stats["workers"]["worker-0"]
        if stats["num_requests"] == 0 and worker["num_free_blocks"] == worker["num_blocks"]:
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"scheduler not idle: {stats}")
        time.sleep(0.2)


def test_models_and_health(openai_client: OpenAI, stack):
    assert [m.id for m in openai_client.models.list().data] == [MODEL]
    assert httpx.get(f"{stack.url}/health").status_code == 200
    assert httpx.get(f"{stack.url}/version").status_code == 200


def test_greedy_completions_match_in_process_engine(openai_client, offline_llm):
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    ref = offline_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24))
    for prompt, expected in zip(prompts, ref, strict=True):
        got = openai_client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=24, temperature=0
        )
        assert got.choices[0].text == expected.outputs[0].text
        assert got.usage.completion_tokens == len(expected.outputs[0].token_ids)
        assert got.usage.prompt_tokens == len(expected.prompt_token_ids)


def test_token_id_prompts_and_lists(openai_client, offline_llm, smollm2_dir):
    ids = token_prompts(Tokenizer(smollm2_dir), [5, 40], seed=2)
    ref = offline_llm.generate(ids, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    got = openai_client.completions.create(
        model=MODEL, prompt=ids, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    texts = [c.text for c in sorted(got.choices, key=lambda c: c.index)]
    assert texts == [r.outputs[0].text for r in ref]


def test_streaming_completion_equals_non_streaming(openai_client):
    kwargs = dict(model=MODEL, prompt="List three colors:", max_tokens=32, temperature=0)
    whole = openai_client.completions.create(**kwargs).choices[0].text
    chunks = list(
        openai_client.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes in (["length"], ["stop"])


def test_chat_non_streaming_and_streaming(openai_client, offline_llm):
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    prompt = offline_llm.tokenizer.apply_chat_template(messages)
    ref = offline_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40))[0]
    got = openai_client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=40, temperature=0
    )
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == ref.outputs[0].text
    stream = list(
        openai_client.chat.completions.create(
            model=MODEL, messages=messages, max_completion_tokens=40, temperature=0, stream=True
        )
    )
    assert stream[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == ref.outputs[0].text


def test_n2_seeded_sampling_is_reproducible(openai_client):
    kwargs = dict(
        model=MODEL, prompt="My favourite animal is", max_tokens=16, temperature=0.9, n=2, seed=1234
    )
    a = openai_client.completions.create(**kwargs)
    b = openai_client.completions.create(**kwargs)
    assert len(a.choices) == 2
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.choices[0].text != a.choices[1].text  # child i uses seed + i


def test_stop_string_spanning_token_boundary(openai_client, offline_llm, smollm2_dir):
    prompt = "The capital of France is"
    full = offline_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24))[0]
    tokens = full.outputs[0].token_ids
    tok = Tokenizer(smollm2_dir)
    # a stop string made of the end of token 2 and the start of token 3
    left, right = tok.decode(tokens[:3]), tok.decode(tokens[:4])
    stop = left[-2:] + right[len(left) :][:2]
    assert stop in full.outputs[0].text
    expected = full.outputs[0].text[: full.outputs[0].text.index(stop)]
    for stream in (False, True):
        resp = openai_client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=[stop], stream=stream
        )
        if stream:
            chunks = [c for c in resp if c.choices]
            text = "".join(c.choices[0].text for c in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            text, finish = resp.choices[0].text, resp.choices[0].finish_reason
        assert text == expected
        assert finish == "stop"


def test_logprobs(openai_client):
    got = openai_client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=4, temperature=0, logprobs=3
    )
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 4
    assert all(len(top) >= 1 for top in lp.top_logprobs)
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value <= 0 and max(top.values()) == pytest.approx(value)  # greedy: the top one
        assert token in top
    chat = openai_client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.bytes is not None for c in content)


def test_64_concurrent_streams_complete(stack, offline_llm, smollm2_dir):
    prompts = token_prompts(Tokenizer(smollm2_dir), [8 + 3 * i for i in range(64)], seed=5)
    ref = offline_llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    )

    async def one(client: httpx.AsyncClient, prompt: list[int]) -> str:
        body = {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": 12,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        text = ""
        async with client.stream("POST", f"{stack.url}/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    text += "".join(c["text"] for c in chunk["choices"])
        return text

    async def run():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    texts = asyncio.run(run())
    assert texts == [r.outputs[0].text for r in ref]
    wait_idle(stack)


def test_client_disconnect_aborts_and_frees_blocks(stack):
    async def run():
        body = {
            "model": MODEL,
            "prompt": "Write a long story about a dragon.",
            "max_tokens": 1000,
            "ignore_eos": True,
            "stream": True,
        }
        async with (
            httpx.AsyncClient(timeout=60) as client,
            client.stream("POST", f"{stack.url}/v1/completions", json=body) as resp,
        ):
            seen = 0
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                if seen >= 3:
                    break  # leave mid-stream
        return seen

    assert asyncio.run(run()) >= 3
    busy = scheduler_stats(stack)
    stats = wait_idle(stack, timeout_s=30)
    assert busy["num_requests"] <= 1 and stats["num_requests"] == 0


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": MODEL, "prompt": "x", "temperature": 5}, 400, "temperature"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": [[1, 2, 10**9]]}, 400, "prompt"),
        ({"model": "no-such-model", "prompt": "x"}, 404, "model"),
        ({"model": MODEL, "prompt": "hello " * 9000}, 400, None),
    ],
)
def test_bad_inputs_get_openai_errors(stack, body, status, param):
    resp = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=30)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    if param:
        assert error["param"] == param
    if "hello" in str(body.get("prompt")):
        assert "maximum context length is" in error["message"]


def test_malformed_requests_never_500(stack):
    url = f"{stack.url}/v1/chat/completions"
    cases = [
        httpx.post(url, content=b"{not json", headers={"content-type": "application/json"}),
        httpx.post(url, content=b"\xff\xfe\x00", headers={"content-type": "application/json"}),
        httpx.post(url, json={"model": MODEL, "messages": "hi"}),
        httpx.post(url, json={"model": MODEL, "messages": [{"role": "user", "content": 5}]}),
        httpx.post(f"{stack.url}/v1/completions", content=b"x" * (40 * 2**20), timeout=120),
    ]
    for resp in cases:
        assert 400 <= resp.status_code < 500, (resp.status_code, resp.text[:200])
        assert "error" in resp.json()
    assert cases[-1].status_code == 413
    assert httpx.get(f"{stack.url}/health").status_code == 200  # nothing crashed
