"""Every sampling parameter through the official `openai` client against the real stack, each
with an effect the client can observe."""

from __future__ import annotations

import httpx
import pytest
from openai import BadRequestError

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"


def complete(client, **kwargs):
    extra = kwargs.pop("extra_body", {})
    return client.completions.create(
        model=MODEL, prompt=kwargs.pop("prompt", PROMPT), extra_body=extra, **kwargs
    )


@pytest.fixture(scope="module")
def greedy_text(openai_client) -> str:
    return complete(openai_client, max_tokens=12, temperature=0).choices[0].text


def token_ids(stack, text: str) -> list[int]:
    resp = httpx.post(
        f"{stack.url}/tokenize", json={"model": MODEL, "prompt": text, "add_special_tokens": False}
    )
    return resp.json()["tokens"]


def test_top_k_one_and_min_p_one_are_greedy(openai_client, greedy_text):
    for extra in ({"top_k": 1}, {"min_p": 1.0}):
        got = complete(openai_client, max_tokens=12, temperature=1.0, seed=3, extra_body=extra)
        assert got.choices[0].text == greedy_text, extra


def test_top_p_tiny_is_greedy(openai_client, greedy_text):
    got = complete(openai_client, max_tokens=12, temperature=1.0, top_p=1e-6, seed=5)
    assert got.choices[0].text == greedy_text


def test_logit_bias_forces_a_token(openai_client, stack):
    [target] = token_ids(stack, " banana")
    got = complete(openai_client, max_tokens=5, temperature=0, logit_bias={str(target): 100})
    assert got.choices[0].text == " banana" * 5


def test_allowed_token_ids_restrict_the_vocabulary(openai_client, stack):
    allowed = token_ids(stack, " yes") + token_ids(stack, " no")
    got = complete(
        openai_client,
        max_tokens=6,
        temperature=0.8,
        seed=1,
        extra_body={"allowed_token_ids": allowed},
    )
    words = got.choices[0].text.split()
    assert len(words) == 6 and set(words) <= {"yes", "no"}


def test_bad_words_are_never_generated(openai_client, greedy_text):
    assert "Paris" in greedy_text
    got = complete(
        openai_client, max_tokens=12, temperature=0, extra_body={"bad_words": ["Paris", " Paris"]}
    )
    assert "Paris" not in got.choices[0].text


def test_min_tokens_defers_eos(openai_client):
    messages = [{"role": "user", "content": "Reply with one word: hello"}]
    short = openai_client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=40, temperature=0
    )
    assert short.choices[0].finish_reason == "stop"
    n = short.usage.completion_tokens + 5
    longer = openai_client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=40, temperature=0, extra_body={"min_tokens": n}
    )
    assert longer.usage.completion_tokens >= n


def test_penalties_change_greedy_output(openai_client):
    prompt = "one two one two one two one two"
    base = complete(openai_client, prompt=prompt, max_tokens=16, temperature=0).choices[0].text
    for kwargs in (
        {"extra_body": {"repetition_penalty": 1.8}},
        {"frequency_penalty": 1.5},
        {"presence_penalty": 1.5},
    ):
        got = complete(openai_client, prompt=prompt, max_tokens=16, temperature=0, **kwargs)
        assert got.choices[0].text != base, kwargs


def test_seed_reproducible_and_sensitive(openai_client):
    a = complete(openai_client, max_tokens=16, temperature=1.0, seed=42).choices[0].text
    b = complete(openai_client, max_tokens=16, temperature=1.0, seed=42).choices[0].text
    c = complete(openai_client, max_tokens=16, temperature=1.0, seed=43).choices[0].text
    assert a == b and a != c


def test_prompt_logprobs(openai_client, stack):
    got = complete(openai_client, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 2})
    prompt_lp = got.choices[0].model_extra["prompt_logprobs"]
    n_prompt = got.usage.prompt_tokens
    assert len(prompt_lp) == n_prompt and prompt_lp[0] is None
    assert all(entry and len(entry) >= 1 for entry in prompt_lp[1:])


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"extra_body": {"top_k": 0.5}}, "top_k"),
        ({"extra_body": {"min_p": 1.5}}, "min_p"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
        ({"logprobs": 21}, "logprobs"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"999999": 1}}, "logit_bias"),
        ({"n": 2, "temperature": 0}, "n"),
        ({"extra_body": {"allowed_token_ids": [10**7]}}, "allowed_token_ids"),
        ({"extra_body": {"min_tokens": 20}, "max_tokens": 5}, "min_tokens"),
    ],
)
def test_invalid_sampling_params_are_400_with_param(openai_client, kwargs, param):
    kwargs.setdefault("max_tokens", 5)
    with pytest.raises(BadRequestError) as err:
        complete(openai_client, **kwargs)
    assert err.value.body["param"].split(".")[0] == param  # e.g. "logit_bias.5"
