"""The in-process engine on the embedded SmolLM2 against transformers, token for token."""

from __future__ import annotations

import pytest
import torch

from bench.workload import token_prompts
from services.offline import LLM, SamplingParams
from shared.tokenizer import Tokenizer

NEW_TOKENS = 64
LENGTHS = [3, 7, 12, 20, 33, 48, 64, 90, 128, 150, 200, 256, 300, 350, 420, 500]


@pytest.fixture(scope="module")
def prompts(smollm2_dir) -> list[list[int]]:
    return token_prompts(Tokenizer(smollm2_dir), LENGTHS, seed=7)


@pytest.fixture(scope="module")
def hf_greedy(smollm2_dir, prompts) -> list[list[int]]:
    """transformers `generate`, one prompt at a time (no padding), greedy, EOS ignored."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    config = GenerationConfig(
        max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
    )
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(torch.tensor([p]), generation_config=config)[0]
            outs.append(ids[len(p) :].tolist())
    return outs


def test_greedy_matches_transformers_with_chunking_and_preemption(smollm2_dir, prompts, hf_greedy):
    # 128-token budget chunks every prompt above it; 56 blocks (896 tokens) cannot hold all
    # 16 requests at once, so some are preempted and recomputed.
    llm = LLM(smollm2_dir, max_num_batched_tokens=128, num_blocks=56, max_num_seqs=16)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert llm.scheduler.num_preemptions > 0
    for i, (out, ref) in enumerate(zip(outs, hf_greedy, strict=True)):
        assert len(ref) == NEW_TOKENS
        assert out.outputs[0].token_ids == ref, f"prompt {i} ({len(prompts[i])} tokens) differs"


def test_messages_survive_the_wire(smollm2_dir, prompts, hf_greedy):
    """Encode and decode every BatchPlan and ModelRunnerOutput: they carry everything needed."""
    llm = LLM(smollm2_dir, max_num_batched_tokens=96, num_blocks=40, serialize_messages=True)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts[:6], params)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy[:6]


def test_prefix_cache_hit_reports_cached_tokens_and_same_output(smollm2_dir, prompts):
    llm = LLM(smollm2_dir, max_num_batched_tokens=512)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    shared_prefix = prompts[-1][:400]
    first = llm.generate([[*shared_prefix, 42, 43, 44]], params)[0]
    computed_before = _computed_tokens(llm)
    second = llm.generate([[*shared_prefix, 42, 43, 44]], params)[0]
    computed = _computed_tokens(llm) - computed_before
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 400  # 25 full blocks; never the last prompt token
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert computed == 403 + 24 - 1 - 400  # only the uncached tail and the decode steps
    other = llm.generate([[*shared_prefix, 7, 8]], params)[0]
    assert other.num_cached_tokens == 400
    fresh = LLM(smollm2_dir, enable_prefix_caching=False).generate([[*shared_prefix, 7, 8]], params)
    assert other.outputs[0].token_ids == fresh[0].outputs[0].token_ids


def _computed_tokens(llm: LLM) -> int:
    return llm.runner.num_tokens_computed
