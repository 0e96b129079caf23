"""Async scheduling through the real stack: the shared stack (async, the default) and a stack
with `--no-async-scheduling` answer a mixed workload identically, streamed or not."""

from __future__ import annotations

import pytest
from openai import OpenAI

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = [
    "The capital of France is",
    "Name three rivers in Europe.",
    "def add(a, b):",
]
# Each: completions keyword arguments. Together they stop in every way the API offers.
CASES = [
    dict(max_tokens=30, temperature=0, stop=["."]),  # a stop string
    dict(max_tokens=30, temperature=0, extra_body={"stop_token_ids": [13, 30]}),
    dict(max_tokens=14, temperature=0, extra_body={"min_tokens": 10, "ignore_eos": False}),
    dict(max_tokens=12, temperature=0.9, top_p=0.9, seed=77, n=3, logprobs=2),
    dict(max_tokens=3, temperature=0, extra_body={"prompt_logprobs": 1}),
    dict(max_tokens=1, temperature=0),
]


@pytest.fixture(scope="module")
def sync_client(sync_stack) -> OpenAI:
    return OpenAI(base_url=f"{sync_stack.url}/v1", api_key="x", max_retries=0, timeout=120)


def summarize(response) -> list:
    extra = response.model_extra or {}
    return [
        (
            c.index,
            c.text,
            c.finish_reason,
            None if c.logprobs is None else c.logprobs.tokens,
            None if c.logprobs is None else [round(x, 3) for x in c.logprobs.token_logprobs],
        )
        for c in sorted(response.choices, key=lambda c: c.index)
    ] + [response.usage.completion_tokens, extra.get("prompt_logprobs") is not None]


def stream_summary(client: OpenAI, kwargs: dict) -> dict[int, tuple[str, str | None]]:
    got: dict[int, tuple[str, str | None]] = {}
    stream = client.completions.create(model=MODEL, prompt=PROMPTS, stream=True, **kwargs)
    for chunk in stream:
        for c in chunk.choices:
            text, finish = got.get(c.index, ("", None))
            got[c.index] = (text + c.text, c.finish_reason or finish)
    return got


@pytest.mark.parametrize("case", range(len(CASES)))
def test_async_answers_like_sync(openai_client, sync_client, case):
    kwargs = CASES[case]
    sync = sync_client.completions.create(model=MODEL, prompt=PROMPTS, **kwargs)
    async_ = openai_client.completions.create(model=MODEL, prompt=PROMPTS, **kwargs)
    assert summarize(async_) == summarize(sync)
    assert stream_summary(openai_client, kwargs) == stream_summary(sync_client, kwargs)


def test_the_cases_stop_in_every_way(sync_client):
    reasons = set()
    for kwargs in CASES:
        response = sync_client.completions.create(model=MODEL, prompt=PROMPTS, **kwargs)
        reasons |= {c.finish_reason for c in response.choices}
        if "stop" in kwargs:
            assert all("." not in c.text for c in response.choices)
    assert reasons == {"stop", "length"}
