"""Scheduler unit tests with hand-made SamplerOutputs (no model, no torch)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler.block_pool import BlockPool
from services.scheduler.request import FinishReason, Request, RequestStatus
from services.scheduler.scheduler import Scheduler
from shared.config import SchedulerConfig
from shared.sampling_params import SamplingParams
from shared.wire import BatchPlan, ModelRunnerOutput

EOS = 2


def make_scheduler(num_blocks=64, budget=64, max_seqs=8, max_len=512, caching=True):
    config = SchedulerConfig(
        max_num_batched_tokens=budget,
        max_num_seqs=max_seqs,
        max_model_len=max_len,
        block_size=16,
        enable_prefix_caching=caching,
    )
    return Scheduler(config, num_blocks, eos_token_ids=(EOS,))


def req(req_id, n_prompt, max_tokens=8, start=100, **kw):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)
    return Request(req_id, list(range(start, start + n_prompt)), params)


def respond(plan: BatchPlan, sched: Scheduler, token=7) -> list:
    """Fake worker: one token for every request whose computed tokens reached its length."""
    ids, sampled = [], []
    for req_id in plan.num_scheduled_tokens:
        r = sched.requests[req_id]
        ids.append(req_id)
        sampled.append([token] if r.num_computed_tokens >= r.num_tokens else [])
    return sched.update(
        ModelRunnerOutput(step_id=plan.step_id, req_ids=ids, sampled_token_ids=sampled)
    )


def test_budget_and_chunked_prefill():
    s = make_scheduler(budget=40)
    s.add_request(req("a", 100))
    s.add_request(req("b", 10))
    plan = s.schedule()
    assert plan.num_scheduled_tokens == {"a": 40}
    assert [n.req_id for n in plan.new_reqs] == ["a"]
    assert respond(plan, s) == []  # mid-prefill: nothing sampled
    plan = s.schedule()
    assert plan.num_scheduled_tokens == {"a": 40}
    assert plan.cached_reqs[0].num_computed_tokens == 40
    respond(plan, s)
    plan = s.schedule()  # a's last 20 tokens plus b's 10 in one mixed step
    assert plan.num_scheduled_tokens == {"a": 20, "b": 10}
    outs = respond(plan, s)
    assert [o.req_id for o in outs] == ["a", "b"]
    plan = s.schedule()  # both decode
    assert plan.num_scheduled_tokens == {"a": 1, "b": 1}


def test_max_num_seqs_limits_running():
    s = make_scheduler(max_seqs=2, budget=512)
    for i in range(3):
        s.add_request(req(f"r{i}", 5))
    plan = s.schedule()
    assert set(plan.num_scheduled_tokens) == {"r0", "r1"}
    assert len(s.waiting) == 1


def test_stop_conditions():
    s = make_scheduler()
    s.add_request(req("len", 4, max_tokens=2))
    s.add_request(req("eos", 4, max_tokens=10))
    s.add_request(req("stop", 4, max_tokens=10, stop_token_ids=[9]))
    s.add_request(req("ign", 4, max_tokens=2, ignore_eos=True))
    plan = s.schedule()
    outs = s.update(
        ModelRunnerOutput(
            step_id=0,
            req_ids=list(plan.num_scheduled_tokens),
            sampled_token_ids=[[5], [EOS], [9], [EOS]],
        )
    )
    by_id = {o.req_id: o for o in outs}
    assert by_id["eos"].finish_reason == FinishReason.STOP
    assert by_id["stop"].finish_reason == FinishReason.STOP and by_id["stop"].stop_token_id == 9
    assert by_id["len"].finish_reason is None and by_id["ign"].finish_reason is None
    plan = s.schedule()
    assert sorted(plan.finished_req_ids) == ["eos", "stop"]
    outs = respond(plan, s)
    assert {o.req_id: o.finish_reason for o in outs} == {
        "len": FinishReason.LENGTH,
        "ign": FinishReason.LENGTH,
    }
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_min_tokens_defers_eos():
    s = make_scheduler()
    s.add_request(req("a", 4, max_tokens=5, min_tokens=2))
    plan = s.schedule()
    out = s.update(ModelRunnerOutput(step_id=0, req_ids=["a"], sampled_token_ids=[[EOS]]))
    assert out[0].finish_reason is None
    plan = s.schedule()
    out = s.update(
        ModelRunnerOutput(step_id=plan.step_id, req_ids=["a"], sampled_token_ids=[[EOS]])
    )
    assert out[0].finish_reason == FinishReason.STOP


def test_preemption_latest_admitted_first():
    # 6 blocks of 16 tokens; three 32-token prompts take 2 blocks each.
    s = make_scheduler(num_blocks=6, budget=512)
    for i, name in enumerate(("first", "second", "third")):
        s.add_request(req(name, 32, max_tokens=20, start=1000 * i))
    plan = s.schedule()
    assert len(plan.new_reqs) == 3 and s.kv.num_free_blocks == 0
    respond(plan, s)
    plan = s.schedule()  # "first" needs a third block: "third" (latest) is preempted
    assert plan.preempted_req_ids == ["third"]
    assert set(plan.num_scheduled_tokens) == {"first", "second"}
    assert s.requests["third"].status == RequestStatus.PREEMPTED
    assert s.waiting.peek().req_id == "third" and s.num_preemptions == 1
    assert s.requests["third"].num_computed_tokens == 0


def test_preempted_request_resumes_with_its_tokens():
    s = make_scheduler(num_blocks=6, budget=512)
    for i, name in enumerate(("a", "b", "c")):
        s.add_request(req(name, 32, max_tokens=3, start=1000 * i))
    respond(s.schedule(), s)
    plan = s.schedule()
    assert plan.preempted_req_ids == ["c"]
    respond(plan, s)
    for _ in range(10):
        plan = s.schedule()
        resumed = [c for c in plan.cached_reqs if c.resumed]
        if resumed:
            break
        respond(plan, s)
    assert resumed[0].req_id == "c"
    c = s.requests["c"]
    assert c.output_token_ids == [7]  # the token sampled before preemption is kept
    # its old blocks were reused by a and b, so it recomputes prompt + output from scratch
    assert resumed[0].num_computed_tokens == 0 and len(resumed[0].new_block_ids) == 3
    assert plan.num_scheduled_tokens["c"] == 33


def test_prefix_cache_hit_never_covers_last_token():
    s = make_scheduler()
    s.add_request(req("a", 48, max_tokens=1))
    respond(s.schedule(), s)  # finishes; its 3 full blocks stay cached
    s.add_request(req("b", 48, max_tokens=1))
    plan = s.schedule()
    new = plan.new_reqs[0]
    assert new.num_computed_tokens == 32 and plan.num_scheduled_tokens["b"] == 16
    s.add_request(req("c", 50, max_tokens=1))
    plan2 = s.schedule()
    assert plan2.new_reqs[0].num_computed_tokens == 48
    assert s.requests["c"].num_cached_tokens == 48


def test_lru_eviction_oldest_freed_first():
    pool = BlockPool(4)
    a, b = pool.allocate(2), pool.allocate(2)
    for i, blk in enumerate(a + b):
        pool.cache_block(blk, bytes([i]), 0)
    pool.free(a)  # freed first -> evicted first
    pool.free(b)
    taken = pool.allocate(2)
    assert [t.block_id for t in taken] == [x.block_id for x in a]
    assert pool.get_cached_block(bytes([0])) is None and pool.get_cached_block(bytes([1])) is None
    assert pool.get_cached_block(bytes([2])) is b[0]


def test_touching_a_hit_protects_it_from_eviction():
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    pool.cache_block(blocks[0], b"x", 0)
    pool.free(blocks)
    pool.touch([blocks[0]])
    assert blocks[0].ref_cnt == 1 and pool.num_free_blocks == 2
    assert [b.block_id for b in pool.allocate(2)] == [1, 2]


def test_abort_frees_blocks():
    s = make_scheduler()
    s.add_request(req("a", 40))
    s.add_request(req("w", 40))
    s.schedule()
    assert s.kv.num_free_blocks < s.kv.num_blocks
    aborted = s.abort(["a", "w", "missing"])
    assert [r.req_id for r in aborted] == ["a", "w"]
    assert s.kv.num_free_blocks == s.kv.num_blocks
    assert not s.has_unfinished()
    assert s.schedule().finished_req_ids == ["a", "w"]


def test_rejects_prompt_beyond_limit_and_duplicates():
    s = make_scheduler(max_len=64)
    with pytest.raises(ValueError):
        s.add_request(req("long", 64))
    s.add_request(req("ok", 10))
    with pytest.raises(ValueError):
        s.add_request(req("ok", 10))


def check_invariants(s: Scheduler) -> None:
    pool = s.kv.pool
    refs = [0] * pool.num_blocks
    for blocks in s.kv.req_blocks.values():
        for b in blocks:
            refs[b.block_id] += 1
    for b in pool.blocks:
        assert b.ref_cnt == refs[b.block_id], b
        assert (b.ref_cnt == 0) == (b.block_id in pool.free_queue), b
    for h, b in pool.cached.items():
        assert b.block_hash == h
    for r in s.running:
        assert len(s.kv.req_blocks[r.req_id]) * 16 >= r.num_computed_tokens
    assert s.num_waiting_tokens == sum(s._queued_tokens.values()) >= 0
    assert set(s._queued_tokens) == {r.req_id for r in s.waiting}


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 120), st.integers(1, 12), st.integers(0, 3), st.booleans()),
        min_size=1,
        max_size=12,
    ),
    st.integers(8, 24),
    st.integers(16, 96),
)
def test_property_refcounts_and_free_list_stay_consistent(reqs, num_blocks, budget):
    s = make_scheduler(num_blocks=num_blocks, budget=budget, max_seqs=4, max_len=num_blocks * 16)
    for i, (n, max_tokens, prefix, _abort_later) in enumerate(reqs):
        # shared prefixes: requests with the same `prefix` start with the same tokens
        tokens = [prefix * 1000 + t for t in range(min(n, num_blocks * 16 - 20))]
        s.add_request(Request(f"r{i}", tokens, SamplingParams(max_tokens=max_tokens)))
    for step in range(400):
        if not s.has_unfinished():
            break
        plan = s.schedule()
        check_invariants(s)
        respond(plan, s, token=5 + step % 3)
        check_invariants(s)
        if step == 3:
            s.abort([f"r{i}" for i, r in enumerate(reqs) if r[3]])
            check_invariants(s)
    assert not s.has_unfinished()
    assert s.kv.num_free_blocks == s.kv.num_blocks
