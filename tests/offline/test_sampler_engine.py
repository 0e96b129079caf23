"""The sampler inside the engine: seeds that hold across batches, preemption and a move to
another engine; min_tokens and logit_bias; logprobs and prompt logprobs against transformers.

A tiny random Llama (conftest `tiny_dir`) keeps most of this cheap; one test runs the
embedded SmolLM2.
"""

from __future__ import annotations

import torch

from services.offline import LLM, SamplingParams
from services.scheduler.request import Request
from shared.wire import TokenLogprobs

EOS = 1  # the tiny models' eos_token_id


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 211, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


SEEDED = SamplingParams(
    temperature=1.0, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True, repetition_penalty=1.1
)


def tokens_of(llm: LLM, prompts, params) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params)]


def run_requests(llm: LLM, requests: list[Request]) -> dict[str, list]:
    """Drive scheduler + runner directly; collect every RequestOutput per request."""
    for request in requests:
        llm.scheduler.add_request(request)
    outputs: dict[str, list] = {r.req_id: [] for r in requests}
    for out in llm._run():
        outputs[out.req_id].append(out)
    return outputs


def test_seeded_requests_hold_across_batches_preemption_and_moves(tiny_dir):
    target = prompt(20, 0)
    alone = tokens_of(LLM(tiny_dir, num_blocks=64), [target], SEEDED)[0]
    assert len(alone) == 24

    others = [
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=1.5, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.7, top_k=5, seed=99, max_tokens=20, ignore_eos=True),
    ]
    mixed = tokens_of(
        LLM(tiny_dir, num_blocks=64),
        [prompt(7, 1), target, prompt(33, 2), prompt(3, 3)],
        [others[0], SEEDED, others[1], others[2]],
    )
    assert mixed[1] == alone

    # 10 blocks of 16 tokens cannot hold eight 44-token requests: preemption and recompute.
    crowded = LLM(tiny_dir, num_blocks=10, max_num_batched_tokens=32)
    prompts = [prompt(20, 10 + i) for i in range(7)]
    params = [others[i % 3] for i in range(7)]
    outs = tokens_of(
        crowded, [*prompts[:4], target, *prompts[4:]], [*params[:4], SEEDED, *params[4:]]
    )
    assert crowded.scheduler.num_preemptions > 0
    assert outs[4] == alone

    # Moved to another engine after 10 tokens: the continuation samples the same tokens.
    moved = run_requests(LLM(tiny_dir, num_blocks=64), [Request("m", target, SEEDED, alone[:10])])
    assert [t for out in moved["m"] for t in out.new_token_ids] == alone[10:]


def test_n_children_use_seed_plus_index(tiny_dir):
    llm = LLM(tiny_dir, num_blocks=64)
    params = SamplingParams(temperature=1.0, n=3, seed=5, max_tokens=8, ignore_eos=True)
    children = [c.token_ids for c in llm.generate([prompt(9, 4)], params)[0].outputs]
    single = SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    assert children[2] == tokens_of(llm, [prompt(9, 4)], single)[0]
    assert len({tuple(c) for c in children}) == 3


def test_min_tokens_holds_back_eos_and_stop_tokens_then_logit_bias_wins(tiny_dir):
    llm = LLM(tiny_dir, num_blocks=64)
    params = [
        SamplingParams(temperature=0.0, min_tokens=5, logit_bias={EOS: 100.0}, max_tokens=20),
        SamplingParams(
            temperature=0.8,
            seed=3,
            min_tokens=3,
            stop_token_ids=[7],
            logit_bias={7: 100.0},
            ignore_eos=True,
            max_tokens=20,
        ),
        SamplingParams(temperature=0.0, logit_bias={EOS: 100.0}, max_tokens=20),
    ]
    eos_late, stop_late, eos_now = tokens_of(llm, [prompt(6, 5)] * 3, params)
    assert len(eos_late) == 6 and eos_late[-1] == EOS and EOS not in eos_late[:-1]
    assert len(stop_late) == 4 and stop_late[-1] == 7 and 7 not in stop_late[:-1]
    assert eos_now == [EOS]


def test_bad_words_and_allowed_tokens_in_the_engine(tiny_dir):
    llm = LLM(tiny_dir, num_blocks=64)
    free = tokens_of(
        llm, [prompt(12, 6)], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    )[0]
    banned = SamplingParams(
        temperature=0.0, max_tokens=6, ignore_eos=True, bad_words_token_ids=[[free[0]], free[1:3]]
    )
    out = tokens_of(llm, [prompt(12, 6)], banned)[0]
    assert out[0] != free[0]
    allowed = SamplingParams(
        temperature=1.0, seed=2, max_tokens=30, ignore_eos=True, allowed_token_ids=[40, 41, 42]
    )
    assert set(tokens_of(llm, [prompt(12, 6)], allowed)[0]) <= {40, 41, 42}


def hf_logprobs(model_dir, token_ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits: row i predicts token i + 1. [len, vocab]"""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0]
    return logits.float().log_softmax(-1)


def assert_matches(entry: TokenLogprobs, token: int, ref_row: torch.Tensor, k: int, atol: float):
    assert entry.token_ids[0] == token
    assert len(entry.token_ids) == k + 1
    torch.testing.assert_close(torch.tensor(entry.logprobs[0]), ref_row[token], atol=atol, rtol=0)
    top = ref_row.topk(k)
    torch.testing.assert_close(torch.tensor(entry.logprobs[1:]), top.values, atol=atol, rtol=0)
    torch.testing.assert_close(ref_row[entry.token_ids[1:]], top.values, atol=atol, rtol=0)
    assert entry.rank == int((ref_row > ref_row[token] + atol).sum()) + 1 or entry.rank == int(
        (ref_row >= ref_row[token] - atol).sum()
    )


def test_prompt_logprobs_arrive_in_chunks_and_match_transformers(tiny_dir):
    # A 16-token budget cuts the 40-token prompt into three chunks; the messages go over the
    # wire codec so None entries and floats survive encoding.
    llm = LLM(tiny_dir, num_blocks=64, max_num_batched_tokens=16, serialize_messages=True)
    ids = prompt(40, 7)
    params = SamplingParams(
        temperature=0.0, max_tokens=3, prompt_logprobs=4, logprobs=2, ignore_eos=True
    )
    outs = run_requests(llm, [Request("p", ids, params)])["p"]
    parts = [o.prompt_logprobs for o in outs if o.prompt_logprobs is not None]
    assert len(parts) == 3
    entries = [e for part in parts for e in part]
    assert len(entries) == len(ids) and entries[0] is None
    output = [t for o in outs for t in o.new_token_ids]
    ref = hf_logprobs(tiny_dir, ids + output)
    for i in range(1, len(ids)):
        assert_matches(entries[i], ids[i], ref[i - 1], 4, atol=1e-4)
    sample_lps = [lp for o in outs for lp in o.logprobs]
    for j, token in enumerate(output):
        assert_matches(sample_lps[j], token, ref[len(ids) - 1 + j], 2, atol=1e-4)


def test_prompt_logprobs_are_sent_once_through_preemption(tiny_dir):
    prompts = [prompt(90, 20 + i) for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, prompt_logprobs=1)
    # 4 requests of 100 tokens need 28 blocks; 12 force recompute, once in mid-prompt.
    crowded = LLM(tiny_dir, num_blocks=12, max_num_batched_tokens=24, enable_prefix_caching=False)
    mid_prompt = []
    update = crowded.runner._update_states

    def spy(plan):
        for req_id in plan.preempted_req_ids:
            state = crowded.runner.requests[req_id]
            mid_prompt.append(state.num_prompt_logprobs_sent < len(state.prompt_token_ids))
        update(plan)

    crowded.runner._update_states = spy
    got = run_requests(crowded, [Request(f"r{i}", p, params) for i, p in enumerate(prompts)])
    want = run_requests(
        LLM(tiny_dir, num_blocks=128), [Request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    )
    assert any(mid_prompt)
    for req_id, outs in got.items():
        entries = [e for o in outs if o.prompt_logprobs for e in o.prompt_logprobs]
        ref = [e for o in want[req_id] if o.prompt_logprobs for e in o.prompt_logprobs]
        assert len(entries) == len(ref) == 90 and entries[0] is None
        for e, r in zip(entries[1:], ref[1:], strict=True):
            assert e.token_ids[0] == r.token_ids[0] and e.rank == r.rank
            assert abs(e.logprobs[0] - r.logprobs[0]) < 1e-4


def test_smollm2_logprobs_match_transformers(smollm2_dir):
    llm = LLM(smollm2_dir, num_blocks=64)
    ids = llm.tokenizer.encode("The capital of France is")
    params = [
        SamplingParams(
            temperature=0.0, max_tokens=8, logprobs=5, prompt_logprobs=3, ignore_eos=True
        ),
        SamplingParams(
            temperature=0.9,
            seed=42,
            max_tokens=8,
            logprobs=5,
            ignore_eos=True,
            repetition_penalty=1.3,
        ),
    ]
    outs = run_requests(llm, [Request("g", ids, params[0]), Request("s", ids, params[1])])
    for name, out in outs.items():
        tokens = [t for o in out for t in o.new_token_ids]
        ref = hf_logprobs(smollm2_dir, ids + tokens)
        raw = [lp for o in out for lp in o.logprobs]
        for j, token in enumerate(tokens):
            assert_matches(raw[j], token, ref[len(ids) - 1 + j], 5, atol=2e-4)
        if name == "g":
            assert all(lp.rank == 1 for lp in raw)
            prompt_lps = [e for o in out if o.prompt_logprobs for e in o.prompt_logprobs]
            assert prompt_lps[0] is None and len(prompt_lps) == len(ids)
            for i in range(1, len(ids)):
                assert_matches(prompt_lps[i], ids[i], ref[i - 1], 3, atol=2e-4)
