"""Async scheduling (on by default) gives the offline engine exactly the outputs of one plan at
a time, on the real model, for a workload that stops in every way and chunks its prompts."""

from __future__ import annotations

import pytest

from services.offline import LLM, GenerationOutput, SamplingParams

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why each of them is prime, in one sentence each.",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a dragon who loved",
    "Q: What is 12 times 12?\nA:",
]


def workload(eos_stop_token: int) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=24),
        SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[13, 30]),
        SamplingParams(temperature=0.0, max_tokens=12, min_tokens=8, prompt_logprobs=2),
        SamplingParams(temperature=0.8, top_p=0.9, seed=1234, n=3, max_tokens=16, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=1),
        SamplingParams(temperature=0.0, max_tokens=60, stop_token_ids=[eos_stop_token]),
    ]


def summary(outputs: list[GenerationOutput]) -> list:
    return [
        (
            [(c.token_ids, c.finish_reason, c.stop_reason) for c in gen.outputs],
            [None if e is None else e.token_ids for e in gen.prompt_logprobs or []],
        )
        for gen in outputs
    ]


@pytest.fixture(scope="module")
def outputs(smollm2_dir) -> dict[bool, list[GenerationOutput]]:
    results = {}
    for async_scheduling in (False, True):
        # a small token budget chunks the prompts (prompt logprobs arrive in parts)
        llm = LLM(
            smollm2_dir,
            kv_cache_gib=0.05,
            max_num_batched_tokens=16,
            async_scheduling=async_scheduling,
        )
        assert llm.scheduler.max_plans_in_flight == (2 if async_scheduling else 1)
        eos = llm.runner.model_config.eos_token_ids[0]
        results[async_scheduling] = llm.generate(PROMPTS, workload(eos))
    return results


def test_async_equals_sync_token_for_token(outputs):
    sync, async_ = outputs[False], outputs[True]
    assert summary(async_) == summary(sync)
    for s, a in zip(sync, async_, strict=True):
        for cs, ca in zip(s.outputs, a.outputs, strict=True):
            for ls, la in zip(cs.logprobs, ca.logprobs, strict=True):
                assert (ls is None) == (la is None)
                if ls is not None:
                    assert ls.token_ids == la.token_ids
                    assert ls.logprobs == pytest.approx(la.logprobs, abs=1e-4)


def test_the_workload_stops_in_every_way(outputs):
    gens = outputs[True]
    reasons = {c.finish_reason for g in gens for c in g.outputs}
    assert reasons == {"stop", "length"}
    assert len(gens[2].outputs[0].token_ids) >= 8  # min_tokens
    assert len(gens[2].prompt_logprobs) == len(gens[2].prompt_token_ids)
    assert len(gens[4].outputs[0].token_ids) == 1
    assert gens[3].outputs[0].logprobs[0] is not None
    assert any(c.stop_reason is not None for g in gens for c in g.outputs)  # a stop token
    assert len({tuple(c.token_ids) for c in gens[3].outputs}) > 1  # seeded choices differ
