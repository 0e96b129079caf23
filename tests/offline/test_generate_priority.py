"""`LLM.generate(..., priority=[...])`, as vLLM's: one priority per prompt, lower first under
the "priority" scheduling policy; a list of another length, or a non-zero priority under
another policy, is refused before anything is scheduled."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from services.offline import LLM, SamplingParams
from services.scheduler.scheduler import RequestOutput
from shared.sampling_params import SamplingParamsError

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12]]


def finish_order(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The ids of the requests of `llm`, in the order they will finish."""
    finished: list[str] = []
    run = llm._run

    def recording() -> Iterator[RequestOutput]:
        for out in run():
            if out.finish_reason is not None:
                finished.append(out.req_id)
            yield out

    monkeypatch.setattr(llm, "_run", recording)
    return finished


def test_lower_priority_values_run_first(tiny_dir, monkeypatch):
    llm = LLM(tiny_dir, num_blocks=32, max_num_seqs=1, scheduling_policy="priority")
    finished = finish_order(llm, monkeypatch)
    outs = llm.generate(PROMPTS, PARAMS, priority=[1, 0, 2])
    assert [o.prompt_token_ids for o in outs] == PROMPTS  # prompt order
    assert finished == [outs[i].request_id + "-0" for i in (1, 0, 2)]
    finished.clear()
    outs = llm.generate(PROMPTS, PARAMS)  # all 0: arrival order
    assert finished == [o.request_id + "-0" for o in outs]


def test_a_priority_per_prompt_under_the_priority_policy(tiny_dir):
    llm = LLM(tiny_dir, num_blocks=32, scheduling_policy="priority")
    with pytest.raises(SamplingParamsError, match="lengths of prompts") as info:
        llm.generate(PROMPTS, PARAMS, priority=[0, 1])
    assert info.value.param == "priority" and not llm.scheduler.requests

    fcfs = LLM(tiny_dir, num_blocks=32)
    with pytest.raises(SamplingParamsError, match="Got priority 1 but Priority scheduling"):
        fcfs.generate(PROMPTS, PARAMS, priority=[0, 1, 0])
    assert not fcfs.scheduler.requests
    outs = fcfs.generate(PROMPTS, PARAMS, priority=[0, 0, 0])  # vLLM accepts zeros
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4, 4]
