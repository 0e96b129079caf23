"""`LLM.generate` checks every prompt and its parameters before scheduling anything, and gives
the choices of n > 1 the seeds of `SamplingParams.for_choice`."""

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
