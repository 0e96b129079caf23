"""`LLM.generate` takes vLLM's prompt forms, checks every prompt and its parameters before
scheduling anything, and gives the choices of n > 1 the seeds of `SamplingParams.for_choice`."""

from __future__ import annotations

import pytest

from services.offline import LLM, SamplingParams
from shared.sampling_params import SamplingParamsError

MAX_MODEL_LEN = 64
GOOD = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_dir) -> LLM:
    return LLM(tiny_dir, num_blocks=32, max_model_len=MAX_MODEL_LEN)


def assert_refused(llm: LLM, prompts, params, param: str) -> None:
    with pytest.raises(SamplingParamsError) as info:
        llm.generate(prompts, params)
    assert isinstance(info.value, ValueError) and info.value.param == param
    assert not llm.scheduler.requests  # not even the valid prompt before it


@pytest.mark.parametrize(
    ("bad", "param"),
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(stop_token_ids=[211]), "stop_token_ids"),  # vocab 211
    ],
)
def test_invalid_parameters_raise_before_scheduling(llm, bad, param):
    assert_refused(llm, [[5, 6, 7], [8, 9]], [GOOD, SamplingParams(**bad)], param)
    assert len(llm.generate([[5, 6, 7]], GOOD)[0].outputs[0].token_ids) == 4  # still usable


def test_bad_prompt_raises_before_scheduling(llm):  # too long, empty, out of vocab
    assert_refused(llm, [[5, 6, 7], [5] * MAX_MODEL_LEN], GOOD, "prompt")
    assert_refused(llm, [[5, 6, 7], []], GOOD, "prompt")
    assert_refused(llm, [[5, 6, 7], [5, 10**6]], GOOD, "prompt")  # an id outside the vocab
    out = llm.generate([[5] * (MAX_MODEL_LEN - 1)], GOOD)[0].outputs[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"  # the context is full


def test_token_id_prompts_match_the_text_prompt(smollm2_dir):
    llm = LLM(smollm2_dir, num_blocks=64, max_model_len=256)
    text = "The capital of France is"
    ids = llm.tokenizer.encode(text)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    forms = [text, {"prompt": text}, {"prompt_token_ids": ids}, ids]
    outs = llm.generate(forms, params)
    assert [o.prompt for o in outs] == [text, text, None, None]
    assert all(o.prompt_token_ids == ids for o in outs)
    expected = outs[0].outputs[0].token_ids
    assert len(expected) == 12 and all(o.outputs[0].token_ids == expected for o in outs)
    for one in ({"prompt_token_ids": ids}, ids, text):  # a single prompt, not in a list
        (out,) = llm.generate(one, params)
        assert out.outputs[0].token_ids == expected


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (
            {"prompt_token_ids": [5], "cache_salt": "x"},
            "unsupported prompt key(s) 'cache_salt': a prompt is a str",
        ),
        ({"prompt": "t5", "prompt_token_ids": [5]}, "a prompt dict holds one key"),
        ({}, "a prompt dict holds one key, got []"),
        ({"prompt": [5, 6]}, "'prompt' holds a list"),
        ({"prompt_token_ids": "t5 t6"}, "'prompt_token_ids' holds a str"),
        ({"prompt_token_ids": [5, "6"]}, "token ids must be ints, got ['6']"),
        ([5, 6.0], "token ids must be ints, got [6.0]"),
        ([[5, 6]], "token ids must be ints, got [[5, 6]]"),
        (None, "got a NoneType: a prompt is a str, a list of token ids, {'prompt': str} or"),
        ({"prompt_token_ids": []}, "The decoder prompt cannot be empty"),
        ({"prompt_token_ids": [5, 211]}, "token_id(s) [211] in prompt contain out-of-vocab"),
    ],
)
def test_a_prompt_in_another_form_is_refused(llm, bad, message):
    with pytest.raises(SamplingParamsError) as info:
        llm.generate([[5, 6, 7], bad], GOOD)
    assert info.value.param == "prompt" and message in str(info.value)
    assert not llm.scheduler.requests
    dict_out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], GOOD)[0].outputs[0]
    assert dict_out.token_ids == llm.generate([5, 6, 7], GOOD)[0].outputs[0].token_ids


def test_two_seeded_choices_use_seed_and_seed_plus_one(llm):
    def params(n: int, seed: int) -> SamplingParams:
        return SamplingParams(temperature=1.0, n=n, seed=seed, max_tokens=8, ignore_eos=True)

    choices = [c.token_ids for c in llm.generate([[3, 4, 5]], params(2, 41))[0].outputs]
    alone = [llm.generate([[3, 4, 5]], params(1, s))[0].outputs[0].token_ids for s in (41, 42)]
    assert choices == alone
    assert choices[0] != choices[1]
    assert [c.token_ids for c in llm.generate([[3, 4, 5]], params(2, 41))[0].outputs] == choices


def test_unknown_keyword_is_refused(tiny_dir):
    with pytest.raises(TypeError, match="num_block"):
        LLM(tiny_dir, num_block=8)
