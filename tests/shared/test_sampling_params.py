"""`validate_sampling_params`: vLLM's ranges, precise messages, the offending field named."""

from __future__ import annotations

import math

import pytest

from shared.sampling_params import (
    GREEDY_EPS,
    INT64_MAX,
    INT64_MIN,
    SamplingParams,
    SamplingParamsError,
    check_prompt_fits,
    is_greedy,
    resolve_max_tokens,
    validate_sampling_params,
)

VOCAB = 1000

INVALID = [
    (dict(n=0), "n", "n must be at least 1, got 0."),
    (dict(n=2, temperature=0.0), "n", "n must be 1 when using greedy sampling, got 2."),
    (dict(temperature=-0.1), "temperature", "temperature must be non-negative, got -0.1."),
    (dict(temperature=2.5), "temperature", "temperature must be in [0, 2], got 2.5."),
    (dict(temperature=math.nan), "temperature", "temperature must be a finite number, got nan."),
    (dict(top_p=0.0), "top_p", "top_p must be in (0, 1], got 0.0."),
    (dict(top_p=1.01), "top_p", "top_p must be in (0, 1], got 1.01."),
    (dict(top_k=-2), "top_k", "top_k must be 0 (disable), or at least 1, got -2."),
    (dict(min_p=1.5), "min_p", "min_p must be in [0, 1], got 1.5."),
    (dict(min_p=-0.1), "min_p", "min_p must be in [0, 1], got -0.1."),
    (
        dict(presence_penalty=2.1),
        "presence_penalty",
        "presence_penalty must be in [-2, 2], got 2.1.",
    ),
    (
        dict(frequency_penalty=-3.0),
        "frequency_penalty",
        "frequency_penalty must be in [-2, 2], got -3.0.",
    ),
    (
        dict(repetition_penalty=0.0),
        "repetition_penalty",
        "repetition_penalty must be greater than zero, got 0.0.",
    ),
    (
        dict(repetition_penalty=math.inf),
        "repetition_penalty",
        "repetition_penalty must be a finite number, got inf.",
    ),
    (dict(max_tokens=0), "max_tokens", "max_tokens must be at least 1, got 0."),
    (
        dict(min_tokens=-1),
        "min_tokens",
        "min_tokens must be greater than or equal to 0, got -1.",
    ),
    (
        dict(min_tokens=9, max_tokens=8),
        "min_tokens",
        "min_tokens must be less than or equal to max_tokens=8, got 9.",
    ),
    (dict(logprobs=-1), "logprobs", "logprobs must be non-negative, got -1."),
    (
        dict(logprobs=21),
        "logprobs",
        "Requested sample logprobs of 21, which is greater than max allowed: 20",
    ),
    (
        dict(prompt_logprobs=25),
        "prompt_logprobs",
        "Requested prompt logprobs of 25, which is greater than max allowed: 20",
    ),
    (
        dict(logprobs_mode="softmax"),
        "logprobs_mode",
        "logprobs_mode must be one of raw_logprobs, raw_logits, processed_logprobs, "
        "processed_logits; got 'softmax'.",
    ),
    (dict(seed=2**63), "seed", f"seed must fit in a signed 64-bit integer, got {2**63}."),
    (
        dict(logit_bias={5: 1.0, 1000: 2.0, -1: 0.0}),
        "logit_bias",
        "token_id(s) [1000, -1] in logit_bias contain out-of-vocab token ids. "
        "Vocabulary size: 1000",
    ),
    (
        dict(logit_bias={5: 100.5}),
        "logit_bias",
        "logit_bias values must be in [-100, 100], got 100.5 for token 5.",
    ),
    (
        dict(allowed_token_ids=[]),
        "allowed_token_ids",
        "allowed_token_ids is not None and empty!",
    ),
    (
        dict(allowed_token_ids=[3, 1000]),
        "allowed_token_ids",
        "token_id(s) [1000] in allowed_token_ids contain out-of-vocab token ids. "
        "Vocabulary size: 1000",
    ),
    (
        dict(stop_token_ids=[4000]),
        "stop_token_ids",
        "token_id(s) [4000] in stop_token_ids contain out-of-vocab token ids. "
        "Vocabulary size: 1000",
    ),
    (dict(bad_words_token_ids=[[1], []]), "bad_words", "bad_words cannot contain an empty word."),
    (
        dict(bad_words_token_ids=[[1, 1001]]),
        "bad_words",
        "token_id(s) [1001] in bad_words contain out-of-vocab token ids. Vocabulary size: 1000",
    ),
]


@pytest.mark.parametrize(("fields", "param", "message"), INVALID)
def test_invalid_params_are_rejected_with_a_precise_message(fields, param, message):
    with pytest.raises(SamplingParamsError) as err:
        validate_sampling_params(SamplingParams(**fields), VOCAB)
    assert err.value.param == param
    assert err.value.message == message
    assert str(err.value) == message


@pytest.mark.parametrize(
    "fields",
    [
        {},
        dict(temperature=0.0),
        dict(temperature=2.0, top_p=1.0, top_k=-1, min_p=1.0),
        dict(top_k=0, min_p=0.0, top_p=1e-9),
        dict(n=4, temperature=0.5, seed=-(2**63)),
        dict(presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=5.0),
        dict(max_tokens=None, min_tokens=100),
        dict(min_tokens=8, max_tokens=8),
        dict(logprobs=0, prompt_logprobs=20, logprobs_mode="processed_logits"),
        dict(logit_bias={0: -100.0, 999: 100.0}, allowed_token_ids=[0, 999]),
        dict(bad_words_token_ids=[[1], [2, 3, 4]], stop_token_ids=[999]),
    ],
)
def test_valid_params_pass(fields):
    assert validate_sampling_params(SamplingParams(**fields), VOCAB) is None


def test_the_module_needs_no_torch():
    import subprocess
    import sys

    code = (
        "import sys, shared.sampling_params; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_greedy_rule():
    assert SamplingParams(temperature=0.0).greedy and SamplingParams(temperature=9e-6).greedy
    assert not SamplingParams(temperature=1e-5).greedy
    assert is_greedy(0.0) and not is_greedy(GREEDY_EPS)


def test_for_choice_gives_each_choice_its_own_seed_inside_int64():
    params = SamplingParams(n=3, seed=7, temperature=0.8)
    assert [params.for_choice(i).seed for i in range(3)] == [7, 8, 9]
    assert {params.for_choice(i).n for i in range(3)} == {1}
    assert SamplingParams(n=2, seed=INT64_MAX).for_choice(1).seed == INT64_MIN
    assert SamplingParams(n=2).for_choice(1).seed is None


def test_max_tokens_is_resolved_against_the_context():
    assert resolve_max_tokens(None, 10, 100) == 90
    assert resolve_max_tokens(90, 10, 100) == 90
    with pytest.raises(SamplingParamsError) as err:
        resolve_max_tokens(91, 10, 100)
    assert err.value.param == "max_tokens"
    assert err.value.message.startswith("This model's maximum context length is 100 tokens.")
    assert "you requested 101 tokens (10 in the messages, 91 in the completion)" in str(err.value)
    with pytest.raises(SamplingParamsError) as err:
        resolve_max_tokens(1, 100, 100, prompt_param="messages")
    assert err.value.param == "messages" and "your request has 100 input tokens" in str(err.value)
    with pytest.raises(SamplingParamsError, match="cannot be empty"):
        check_prompt_fits(0, 100)
    check_prompt_fits(99, 100)
