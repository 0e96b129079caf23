"""Prefix blocks loaded back into the device pool before a request is admitted: from the
worker's own lower tiers (a Scheduler with tiers and a fake worker that reports its loads),
and from another worker of a WorkerPool over the KV-transfer path."""

from __future__ import annotations

from typing import NoReturn

import msgspec

from services.scheduler.block_pool import BlockPool
from services.scheduler.kv_loads import REMOTE, KVLoads, LoadJob, find_sources
from services.scheduler.kv_tiers import LowerTiers, TierSlot
from services.scheduler.placement import Placement
from services.scheduler.request import Request, RequestStatus
from services.scheduler.scheduler import MAX_PREFIX_LOADS, Scheduler, plan_has_work
from services.scheduler.worker_pool import WorkerHandle, WorkerPool
from shared.wire import KV_DEVICE, KV_DISK, KV_HOST, KVLoad, ModelRunnerOutput, WorkerHello
from tests.scheduler.fakes import make_hello, unpaced_config
from tests.scheduler.test_kv_tiers import (
    evict_device,
    hashes_of,
    make_scheduler,
    req,
    respond,
    run_to_end,
    tokens,
)

PROMPT = tokens(100, 64)  # four full blocks
LONGER = [*PROMPT, *tokens(900, 20)]  # PROMPT and 20 more tokens: five full blocks


def status(request: Request) -> RequestStatus:
    """The request's status now (read afresh after each step)."""
    return request.status


def host_entry(s: Scheduler, block_hash: bytes) -> TierSlot:
    entry = s.kv.tiers.host.get(block_hash)
    assert entry is not None, "not in the host tier"
    return entry


def offloaded(s: Scheduler, *prompts: list[int]) -> None:
    """Run a request of each prompt to its end, then reuse every device block: their prefix
    blocks are in the host tier only."""
    run_to_end(s, *(req(f"warm{i}", p, max_tokens=1) for i, p in enumerate(prompts)))
    evict_device(s)
    for prompt in prompts:
        for block_hash in hashes_of(prompt):
            assert s.kv.pool.get_cached_block(block_hash) is None
            assert s.kv.tiers.host.get(block_hash) is not None


# ---- KVLoads -----------------------------------------------------------------------------


def test_loads_are_grouped_by_source_and_end_when_every_one_is_reported() -> None:
    tiers = LowerTiers(2, 4)
    blocks = [(i, bytes([i])) for i in range(4)]
    tiers.offload(blocks, step=0)  # tail first in real use; here 0 and 1 spill to disk
    tiers.take_copies()
    hashes = [bytes([i]) for i in range(4)]
    sources = find_sources(tiers, None, [*hashes, b"missing", hashes[0]])
    assert [(x.tier, x.origin) for x in sources] == [
        (KV_DISK, KV_DISK),
        (KV_DISK, KV_DISK),
        (KV_HOST, KV_HOST),
        (KV_HOST, KV_HOST),
    ]  # up to the first block found nowhere
    request = req("r", tokens(0, 80))
    loads = KVLoads()
    device = BlockPool(8).allocate(4)
    job = LoadJob(request, sources, set(), 64, False, 3)
    kv_loads = loads.start(job, device)
    assert [(x.src_tier, x.block_ids, x.remote_address) for x in kv_loads] == [
        (KV_DISK, [0, 1], ""),
        (KV_HOST, [2, 3], ""),
    ]
    assert [x.src for x in kv_loads] == [
        [(tiers.disk.get(x) or _fail()).slot for x in hashes[:2]],
        [(tiers.host.get(x) or _fail()).slot for x in hashes[2:]],
    ]
    assert len(loads) == 1 and loads.requests() == [request]
    assert [(tiers.lookup(x) or _fail()).pins for x in hashes] == [1, 1, 1, 1]
    assert loads.reported([kv_loads[0].load_id], []) == []  # one of two
    assert loads.reported([], [kv_loads[1].load_id, 99]) == [job] and job.failed
    assert len(loads) == 0
    assert [(tiers.lookup(x) or _fail()).pins for x in hashes] == [0, 0, 0, 0]
    assert loads.reported([kv_loads[0].load_id], []) == []  # late: ignored


def _fail() -> NoReturn:
    raise AssertionError("not in the tiers")


# ---- a Scheduler loading from its own tiers ----------------------------------------------


def test_an_offloaded_prefix_is_loaded_before_the_request_is_admitted() -> None:
    s = make_scheduler()
    offloaded(s, PROMPT)
    hashes = hashes_of(PROMPT)
    slots = [host_entry(s, x).slot for x in hashes]
    s.add_request(req("b", LONGER, max_tokens=2))
    plan = s.schedule()
    assert plan.num_scheduled_tokens == {} and plan.new_reqs == []
    (load,) = plan.kv_loads
    assert (load.src_tier, load.src, load.remote_address) == (KV_HOST, slots, "")
    b = s.requests["b"]
    assert status(b) == RequestStatus.WAITING_FOR_KV
    assert s.request_statuses() == {"b": "waiting_for_kv"}
    assert load.block_ids == s.kv.block_ids(b) and len(load.block_ids) == 4
    assert [host_entry(s, x).pins for x in hashes] == [1, 1, 1, 1]
    assert plan_has_work(plan) and s.has_unfinished() and s.unfinished_requests() == [b]
    assert s.make_stats().num_waiting == 1
    # the next plan, built before the load is reported: b neither runs nor loads again
    plan2 = s.schedule()
    assert "b" not in plan2.num_scheduled_tokens and plan2.kv_loads == [] and not plan2.new_reqs
    assert status(b) == RequestStatus.WAITING_FOR_KV
    respond(plan, s)  # the load plan's result reports the load
    # back in the queue, its loaded blocks in the prefix cache rather than held
    assert status(b) == RequestStatus.WAITING and b.num_computed_tokens == 0
    assert s.kv.block_ids(b) == [] and b.num_prefix_loads == 1
    for block_id, block_hash in zip(load.block_ids, hashes, strict=True):
        cached = s.kv.pool.get_cached_block(block_hash)  # findable before b is admitted
        assert cached is not None and cached.block_id == block_id
        assert cached.ready_step == plan.step_id
    respond(plan2, s)
    assert [host_entry(s, x).pins for x in hashes] == [0, 0, 0, 0]
    plan3 = s.schedule()
    (new,) = plan3.new_reqs
    assert (new.req_id, new.num_computed_tokens) == ("b", 64)
    assert plan3.num_scheduled_tokens == {"b": 20}
    assert new.block_ids[:4] == load.block_ids and len(new.block_ids) == 6  # 84 tokens
    assert new.block_ids == s.kv.block_ids(b)
    for block_id, block_hash in zip(load.block_ids, hashes, strict=True):
        cached = s.kv.pool.get_cached_block(block_hash)
        assert cached is not None and cached.block_id == block_id
    assert s.make_stats().kv_tier_hits == {KV_HOST: 64}
    outputs = respond(plan3, s)
    assert [(o.req_id, o.num_cached_tokens) for o in outputs] == [("b", 64)]


def test_a_request_whose_prefix_is_on_the_device_loads_nothing() -> None:
    s = make_scheduler()
    run_to_end(s, req("a", PROMPT, max_tokens=1))
    s.add_request(req("b", LONGER))
    plan = s.schedule()
    assert plan.kv_loads == [] and plan.new_reqs[0].num_computed_tokens == 64


def test_only_the_blocks_after_the_device_hits_are_loaded() -> None:
    s = make_scheduler()
    offloaded(s, PROMPT)
    run_to_end(s, req("head", PROMPT[:20], max_tokens=1))  # block 0 on the device again
    hashes = hashes_of(PROMPT)
    head = s.kv.pool.get_cached_block(hashes[0])
    assert head is not None
    assert s.make_stats().kv_tier_hits == {KV_HOST: 16}  # head loaded it
    s.add_request(req("b", LONGER))
    plan = s.schedule()
    (load,) = plan.kv_loads
    assert load.src == [host_entry(s, x).slot for x in hashes[1:]]
    assert s.kv.block_ids(s.requests["b"]) == [head.block_id, *load.block_ids]
    respond(plan, s)
    new = s.schedule().new_reqs[0]
    assert new.num_computed_tokens == 64 and new.block_ids[:4] == [head.block_id, *load.block_ids]
    assert s.make_stats().kv_tier_hits == {KV_HOST: 16 + 48}


def test_a_prefix_longer_than_the_free_pool_loads_what_fits_and_computes_the_rest() -> None:
    s = make_scheduler()
    offloaded(s, PROMPT)
    s.add_request(req("r", tokens(700, 90), max_tokens=2))
    respond(s.schedule(), s)
    assert s.kv.num_free_blocks == 2  # r holds six
    hashes = hashes_of(PROMPT)
    s.add_request(req("b", LONGER, max_tokens=1))
    plan = s.schedule()
    (load,) = plan.kv_loads
    assert load.src == [host_entry(s, x).slot for x in hashes[:2]]
    assert [host_entry(s, x).pins for x in hashes] == [1, 1, 0, 0]
    respond(plan, s)  # r finishes too: room for the rest of the prefix
    plan = s.schedule()
    (rest,) = plan.kv_loads
    assert rest.src == [host_entry(s, x).slot for x in hashes[2:]] and not plan.new_reqs
    respond(plan, s)
    plan = s.schedule()
    (new,) = plan.new_reqs
    assert (new.req_id, new.num_computed_tokens) == ("b", 64)
    assert new.block_ids[:4] == load.block_ids + rest.block_ids and len(new.block_ids) == 6
    assert plan.num_scheduled_tokens == {"b": len(LONGER) - 64}


def test_a_request_stops_loading_once_its_loads_were_evicted_twice() -> None:
    s = make_scheduler()
    offloaded(s, PROMPT)
    hashes = hashes_of(PROMPT)
    s.add_request(req("b", LONGER, max_tokens=1))
    for _ in range(MAX_PREFIX_LOADS):
        plan = s.schedule()
        assert len(plan.kv_loads) == 1
        respond(plan, s)
        for x in hashes:  # the loaded blocks are evicted before b is admitted
            block = s.kv.pool.get_cached_block(x)
            if block is not None:
                s.kv.pool.uncache(block)
    plan = s.schedule()
    assert plan.kv_loads == []
    assert plan.new_reqs[0].num_computed_tokens == 0


def test_a_failed_load_sends_the_request_back_to_compute_its_prefix() -> None:
    s = make_scheduler()
    offloaded(s, PROMPT)
    run_to_end(s, req("head", PROMPT[:20], max_tokens=1))  # block 0 on the device again
    hashes = hashes_of(PROMPT)
    s.add_request(req("b", LONGER, max_tokens=2))
    plan = s.schedule()
    assert len(plan.kv_loads) == 1
    respond(plan, s, fail_loads=True)
    b = s.requests["b"]
    assert status(b) == RequestStatus.WAITING and b.num_prefix_loads == MAX_PREFIX_LOADS
    assert [host_entry(s, x).pins for x in hashes[1:]] == [0, 0, 0]
    assert s.kv.pool.get_cached_block(hashes[1]) is None  # the blocks it loaded into
    plan = s.schedule()
    assert plan.kv_loads == []  # never again: it computes
    (new,) = plan.new_reqs
    assert new.num_computed_tokens == 16  # its device hit only
    assert plan.num_scheduled_tokens == {"b": len(LONGER) - 16}
    assert s.make_stats().kv_tier_hits == {KV_HOST: 16}  # head's load only
    respond(plan, s)
    run_to_end(s)


def test_a_failed_load_of_a_request_without_device_hits_computes_from_zero() -> None:
    s = make_scheduler()
    offloaded(s, PROMPT)
    s.add_request(req("b", LONGER, max_tokens=1))
    respond(s.schedule(), s, fail_loads=True)
    plan = s.schedule()
    assert plan.kv_loads == [] and plan.new_reqs[0].num_computed_tokens == 0
    assert s.kv.num_free_blocks == s.kv.num_blocks - 6
    respond(plan, s)
    run_to_end(s)
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_abort_while_waiting_for_kv_releases_the_pins() -> None:
    s = make_scheduler()
    offloaded(s, PROMPT)
    hashes = hashes_of(PROMPT)
    s.add_request(req("b", LONGER))
    load_plan = s.schedule()
    assert status(s.requests["b"]) == RequestStatus.WAITING_FOR_KV
    assert [r.req_id for r in s.abort(["b"])] == ["b"]
    assert [host_entry(s, x).pins for x in hashes] == [0, 0, 0, 0]
    assert not s.has_unfinished() and s.unfinished_requests() == []
    assert s.num_waiting_tokens == 0 and s.kv.num_free_blocks == s.kv.num_blocks
    plan = s.schedule()
    assert plan.finished_req_ids == []  # the worker never held it
    respond(load_plan, s)  # its load reported late: ignored
    assert not s.has_unfinished() and s.request_statuses() == {}
    # its slots are evictable again
    s.kv.tiers.offload([(i, bytes([i])) for i in range(32)], s.step_id)
    assert all(s.kv.tiers.lookup(x) is None for x in hashes)


def _preempt_y(s: Scheduler) -> None:
    """x and y fill the pool; x's first decode preempts y (whose blocks are offloaded, the
    last one then reused by x), and x finishes in the next step."""
    s.add_request(req("x", tokens(300, 64), max_tokens=2))
    s.add_request(req("y", PROMPT, max_tokens=4))
    respond(s.schedule(), s)
    plan = s.schedule()
    assert plan.preempted_req_ids == ["y"] and len(plan.kv_copies) == 1
    respond(plan, s)
    assert "x" not in s.requests


def test_a_preempted_request_resumes_by_loading_its_offloaded_blocks() -> None:
    s = make_scheduler()
    _preempt_y(s)
    hashes = hashes_of(PROMPT)
    hits = [s.kv.pool.get_cached_block(x) for x in hashes]
    assert hits[3] is None and all(hits[:3])  # its tail block was reused by x
    plan = s.schedule()
    (load,) = plan.kv_loads
    assert load.src == [host_entry(s, hashes[3]).slot] and load.src_tier == KV_HOST
    y = s.requests["y"]
    assert status(y) == RequestStatus.WAITING_FOR_KV and not plan.cached_reqs
    respond(plan, s)
    assert status(y) == RequestStatus.PREEMPTED and y.num_computed_tokens == 0
    plan = s.schedule()
    (resumed,) = plan.cached_reqs
    assert resumed.req_id == "y" and resumed.resumed and resumed.num_computed_tokens == 64
    device_hits = [b.block_id for b in hits[:3] if b]
    assert resumed.new_block_ids[:4] == [*device_hits, *load.block_ids]
    assert resumed.new_block_ids == s.kv.block_ids(y) and len(resumed.new_block_ids) == 5
    assert plan.num_scheduled_tokens == {"y": 1}  # its sampled token
    assert s.make_stats().kv_tier_hits == {KV_HOST: 16}
    respond(plan, s)
    run_to_end(s)
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_abort_of_a_preempted_request_waiting_for_kv_tells_the_worker() -> None:
    s = make_scheduler()
    _preempt_y(s)
    hashes = hashes_of(PROMPT)
    s.schedule()
    assert status(s.requests["y"]) == RequestStatus.WAITING_FOR_KV
    s.abort(["y"])
    assert host_entry(s, hashes[3]).pins == 0
    assert s.schedule().finished_req_ids == ["y"]  # the worker holds its state from before
    assert not s.has_unfinished()


def test_a_failed_load_of_a_preempted_request_resumes_it_computing() -> None:
    s = make_scheduler()
    _preempt_y(s)
    respond(s.schedule(), s, fail_loads=True)
    y = s.requests["y"]
    assert status(y) == RequestStatus.PREEMPTED
    plan = s.schedule()
    (resumed,) = plan.cached_reqs
    assert resumed.resumed and resumed.num_computed_tokens == 48 and plan.kv_loads == []
    assert plan.num_scheduled_tokens == {"y": 65 - 48}


def test_lost_slots_are_not_loaded() -> None:
    s = make_scheduler()
    offloaded(s, PROMPT)
    hashes = hashes_of(PROMPT)
    lost = host_entry(s, hashes[1]).slot
    respond(s.schedule(), s, lost={KV_HOST: [lost]})
    assert s.make_stats().kv_tier_blocks_lost == 1
    s.add_request(req("b", LONGER))
    plan = s.schedule()
    (load,) = plan.kv_loads  # the chain breaks at the lost block
    assert load.src == [host_entry(s, hashes[0]).slot]
    respond(plan, s)
    new = s.schedule().new_reqs[0]
    assert new.num_computed_tokens == 16


def test_a_request_with_prompt_logprobs_never_loads() -> None:
    s = make_scheduler()
    offloaded(s, PROMPT)
    s.add_request(req("b", LONGER, prompt_logprobs=1))
    plan = s.schedule()
    assert plan.kv_loads == []
    assert plan.new_reqs[0].num_computed_tokens == 0
    assert plan.num_scheduled_tokens == {"b": len(LONGER)}
    assert all(host_entry(s, x).pins == 0 for x in hashes_of(PROMPT))


def test_a_scheduler_without_tiers_never_loads() -> None:
    s = make_scheduler(tiers=False)
    run_to_end(s, req("a", PROMPT, max_tokens=1))
    evict_device(s)
    s.add_request(req("b", LONGER))
    plan = s.schedule()
    assert plan.kv_loads == [] and plan.kv_copies == []
    assert plan.new_reqs[0].num_computed_tokens == 0


def test_loads_beyond_the_plan_byte_window_wait_for_the_next_plan() -> None:
    other = tokens(300, 64)
    # 10 MB blocks: the default window (1 GB/s for 20 ms) holds two; the first request's four
    # go anyway, the second request's wait
    s = make_scheduler(block_bytes=10**7)
    assert s._load_window_bytes() == 2 * 10**7
    offloaded(s, PROMPT, other)
    s.add_request(req("b", LONGER))
    s.add_request(req("d", [*other, *tokens(900, 20)]))
    plan = s.schedule()
    assert len(plan.kv_loads) == 1 and plan.kv_loads[0].src == [
        host_entry(s, x).slot for x in hashes_of(PROMPT)
    ]
    d = s.requests["d"]
    assert status(d) == RequestStatus.WAITING and s.kv.block_ids(d) == []
    assert all(host_entry(s, x).pins == 0 for x in hashes_of(other))
    plan2 = s.schedule()
    (load,) = plan2.kv_loads
    assert load.src == [host_entry(s, x).slot for x in hashes_of(other)]
    assert status(d) == RequestStatus.WAITING_FOR_KV


def test_loads_within_the_plan_byte_window_share_a_plan() -> None:
    other = tokens(300, 64)
    s = make_scheduler(16, block_bytes=1000)
    offloaded(s, PROMPT, other)
    s.add_request(req("b", LONGER))
    s.add_request(req("d", [*other, *tokens(900, 20)]))
    plan = s.schedule()
    assert len(plan.kv_loads) == 2
    assert {r.status for r in s.requests.values()} == {RequestStatus.WAITING_FOR_KV}
    respond(plan, s)
    plan = s.schedule()
    assert sorted((n.req_id, n.num_computed_tokens) for n in plan.new_reqs) == [
        ("b", 64),
        ("d", 64),
    ]


def test_requests_loaded_by_one_plan_are_admitted_in_arrival_order() -> None:
    """fcfs: b came first, so it is admitted first, however its loads were reported."""
    other = tokens(300, 64)
    s = make_scheduler(16, budget=40)
    offloaded(s, PROMPT, other)
    s.add_request(req("b", LONGER))
    s.add_request(req("d", [*other, *tokens(900, 20)]))
    plan = s.schedule()
    assert [load.src for load in plan.kv_loads] == [
        [host_entry(s, x).slot for x in hashes_of(PROMPT)],
        [host_entry(s, x).slot for x in hashes_of(other)],
    ]
    respond(plan, s)
    assert [r.req_id for r in s.waiting] == ["b", "d"]
    plan = s.schedule()  # 20 tokens each: room for both
    assert [n.req_id for n in plan.new_reqs] == ["b", "d"]


def test_measured_load_bandwidth_widens_the_window() -> None:
    s = make_scheduler(block_bytes=10**7)
    offloaded(s, PROMPT)
    s.add_request(req("b", LONGER, max_tokens=1))
    plan = s.schedule()
    s.update(
        ModelRunnerOutput(
            step_id=plan.step_id,
            kv_loads_done=[x.load_id for x in plan.kv_loads],
            kv_load_bytes=4 * 10**7,
            kv_load_s=0.01,  # 4 GB/s
        )
    )
    assert s.kv_load_bps == 1e9 + 0.5 * (4e9 - 1e9)
    assert s._load_window_bytes() == s.kv_load_bps * 0.02


# ---- fetched from another worker ---------------------------------------------------------


def hello_of(worker_id: str, *, block_bytes: int = 4096) -> WorkerHello:
    """A worker with 8 device blocks, 32 host slots and a KV-transfer server."""
    return msgspec.structs.replace(
        make_hello(worker_id, instance_id=f"inst-{worker_id}", num_blocks=8),
        kv_transfer_address=f"{worker_id}.workers:7000",
        kv_block_bytes=block_bytes,
        num_host_blocks=32,
    )


def make_pool(*workers: str) -> tuple[WorkerPool, list[WorkerHandle]]:
    pool = WorkerPool(unpaced_config(max_num_batched_tokens=256))
    return pool, [pool.register(hello_of(w))[0] for w in workers]


def device_block_ids(core: Scheduler, prompt: list[int]) -> list[int]:
    blocks = [core.kv.pool.get_cached_block(x) for x in hashes_of(prompt)]
    assert all(blocks)
    return [b.block_id for b in blocks if b]


def ref_cnts(core: Scheduler, prompt: list[int]) -> list[int]:
    blocks = [core.kv.pool.get_cached_block(x) for x in hashes_of(prompt)]
    return [b.ref_cnt for b in blocks if b]


def test_worker_pool_builds_each_core_with_its_tiers_and_the_fleet() -> None:
    pool = WorkerPool(unpaced_config())
    w, _ = pool.register(
        msgspec.structs.replace(
            make_hello("w"), num_host_blocks=12, num_disk_blocks=30, kv_block_bytes=512
        )
    )
    assert (w.core.kv.tiers.host.num_slots, w.core.kv.tiers.disk.num_slots) == (12, 30)
    assert w.core.kv_block_bytes == 512 and w.core.remote is not None
    off = WorkerPool(unpaced_config(enable_prefix_caching=False))
    v, _ = off.register(make_hello("v"))
    assert v.core.remote is None and not v.core.kv.tiers.enabled


def test_a_prefix_computed_on_one_worker_is_fetched_by_another() -> None:
    _, (a, b) = make_pool("a", "b")
    run_to_end(a.core, req("a1", PROMPT, max_tokens=1))
    assert a.core.last_result_step >= 0
    block_ids = device_block_ids(a.core, PROMPT)
    assert ref_cnts(a.core, PROMPT) == [0, 0, 0, 0]
    b.core.add_request(req("b1", LONGER, max_tokens=1))
    plan = b.core.schedule()
    (load,) = plan.kv_loads
    assert load == KVLoad(
        load_id=load.load_id,
        block_ids=load.block_ids,
        src_tier=KV_DEVICE,
        src=block_ids,
        remote_address=a.hello.kv_transfer_address,
        remote_instance_id=a.hello.instance_id,
    )
    assert ref_cnts(a.core, PROMPT) == [1, 1, 1, 1]  # pinned on a
    assert status(b.core.requests["b1"]) == RequestStatus.WAITING_FOR_KV
    respond(b.core.schedule(), b.core)  # a result without the load report
    assert ref_cnts(a.core, PROMPT) == [1, 1, 1, 1]
    respond(plan, b.core)
    assert ref_cnts(a.core, PROMPT) == [0, 0, 0, 0]
    assert a.core.kv.num_free_blocks == a.core.kv.num_blocks
    plan = b.core.schedule()
    assert [(n.req_id, n.num_computed_tokens) for n in plan.new_reqs] == [("b1", 64)]
    assert b.core.make_stats().kv_tier_hits == {REMOTE: 64}


def test_a_failed_fetch_releases_the_pins_and_computes() -> None:
    _, (a, b) = make_pool("a", "b")
    run_to_end(a.core, req("a1", PROMPT, max_tokens=1))
    b.core.add_request(req("b1", LONGER, max_tokens=1))
    respond(b.core.schedule(), b.core, fail_loads=True)
    assert ref_cnts(a.core, PROMPT) == [0, 0, 0, 0]
    plan = b.core.schedule()
    assert plan.kv_loads == [] and plan.new_reqs[0].num_computed_tokens == 0


def test_a_block_whose_computing_step_was_not_answered_is_not_offered() -> None:
    _, (a, b, c) = make_pool("a", "b", "c")
    a.core.add_request(req("a1", PROMPT, max_tokens=8))
    a_plan = a.core.schedule()  # computes PROMPT's blocks; no result yet
    b.core.add_request(req("b1", LONGER))
    plan = b.core.schedule()
    assert plan.kv_loads == [] and plan.new_reqs[0].num_computed_tokens == 0
    assert ref_cnts(a.core, PROMPT) == [1, 1, 1, 1]  # a1's own
    respond(a_plan, a.core)
    c.core.add_request(req("c1", LONGER))
    (load,) = c.core.schedule().kv_loads
    assert load.remote_address == a.hello.kv_transfer_address and load.src_tier == KV_DEVICE
    assert ref_cnts(a.core, PROMPT) == [2, 2, 2, 2]  # a1's and c1's fetch


def test_an_unhealthy_worker_is_not_fetched_from() -> None:
    _, (a, b, c) = make_pool("a", "b", "c")
    run_to_end(a.core, req("a1", PROMPT, max_tokens=1))
    a.healthy = False
    b.core.add_request(req("b1", LONGER))
    plan = b.core.schedule()
    assert plan.kv_loads == [] and ref_cnts(a.core, PROMPT) == [0, 0, 0, 0]
    a.healthy = True
    c.core.add_request(req("c1", LONGER))
    assert len(c.core.schedule().kv_loads) == 1


def test_a_worker_without_a_transfer_address_is_not_fetched_from() -> None:
    pool = WorkerPool(unpaced_config(max_num_batched_tokens=256))
    a, _ = pool.register(msgspec.structs.replace(hello_of("a"), kv_transfer_address=""))
    b, _ = pool.register(hello_of("b"))
    run_to_end(a.core, req("a1", PROMPT, max_tokens=1))
    b.core.add_request(req("b1", LONGER))
    assert b.core.schedule().kv_loads == []


def test_a_worker_with_other_sized_blocks_is_not_fetched_from() -> None:
    """Blocks of another byte size (another KV dtype or layout) cannot be copied in."""
    pool = WorkerPool(unpaced_config(max_num_batched_tokens=256))
    a, _ = pool.register(hello_of("a", block_bytes=4096))
    b, _ = pool.register(hello_of("b", block_bytes=8192))
    c, _ = pool.register(hello_of("c", block_bytes=4096))
    run_to_end(a.core, req("a1", PROMPT, max_tokens=1))
    c.core.add_request(req("c1", LONGER))
    assert len(c.core.schedule().kv_loads) == 1  # same size: fetched
    b.core.add_request(req("b1", LONGER))
    plan = b.core.schedule()
    assert plan.kv_loads == [], "fetched blocks of 4096 bytes into blocks of 8192"
    assert plan.new_reqs[0].num_computed_tokens == 0


def test_a_host_slot_is_offered_only_once_the_plan_writing_it_was_answered() -> None:
    _, (a, b, c) = make_pool("a", "b", "c")
    run_to_end(a.core, req("a1", PROMPT, max_tokens=1))  # a1 finishes in result 0
    a.core.add_request(req("fill", tokens(5000, 127), max_tokens=1))
    a_plan = a.core.schedule()  # writes PROMPT's blocks to host, then reuses their blocks
    assert len(a_plan.kv_copies) == 1 and a_plan.step_id > a.core.last_result_step
    assert all(a.core.kv.pool.get_cached_block(x) is None for x in hashes_of(PROMPT))
    b.core.add_request(req("b1", LONGER))
    plan = b.core.schedule()
    assert plan.kv_loads == [], (
        f"fetches host slots that a's plan {a_plan.step_id} writes; a answered only up to "
        f"step {a.core.last_result_step}"
    )
    respond(a_plan, a.core)
    c.core.add_request(req("c1", LONGER))
    (load,) = c.core.schedule().kv_loads
    assert (load.src_tier, load.remote_address) == (KV_HOST, a.hello.kv_transfer_address)
    assert load.src == [host_entry(a.core, x).slot for x in hashes_of(PROMPT)]
    assert [host_entry(a.core, x).pins for x in hashes_of(PROMPT)] == [1, 1, 1, 1]


def test_a_host_slot_written_by_a_preempting_plan_is_offered_once_it_was_answered() -> None:
    _, (a, b, c) = make_pool("a", "b", "c")
    a.core.add_request(req("x", tokens(300, 64), max_tokens=2))
    a.core.add_request(req("y", PROMPT, max_tokens=4))
    respond(a.core.schedule(), a.core)
    a_plan = a.core.schedule()  # preempts y: its blocks go to host, its last one to x
    assert a_plan.preempted_req_ids == ["y"] and len(a_plan.kv_copies) == 1
    hashes = hashes_of(PROMPT)
    b.core.add_request(req("b1", LONGER))
    (load,) = b.core.schedule().kv_loads  # y's first three blocks, still on a's device
    assert load.src_tier == KV_DEVICE and len(load.src) == 3
    assert host_entry(a.core, hashes[3]).pins == 0  # not offered yet
    respond(a_plan, a.core)
    c.core.add_request(req("c1", LONGER))
    loads = c.core.schedule().kv_loads
    assert [(x.src_tier, len(x.src), x.remote_address) for x in loads] == [
        (KV_DEVICE, 3, a.hello.kv_transfer_address),
        (KV_HOST, 1, a.hello.kv_transfer_address),
    ]
    assert loads[1].src == [host_entry(a.core, hashes[3]).slot]


def test_a_host_slot_of_another_worker_is_pinned_until_the_fetch_is_reported() -> None:
    _, (a, b) = make_pool("a", "b")
    run_to_end(a.core, req("a1", PROMPT, max_tokens=1))
    evict_device(a.core)
    b.core.add_request(req("b1", LONGER, max_tokens=1))
    plan = b.core.schedule()
    (load,) = plan.kv_loads
    assert (load.src_tier, load.remote_instance_id) == (KV_HOST, a.hello.instance_id)
    hashes = hashes_of(PROMPT)
    assert [host_entry(a.core, x).pins for x in hashes] == [1, 1, 1, 1]
    # a's host tier fills up meanwhile: the pinned slots stay
    a.core.kv.tiers.offload([(i, bytes([i])) for i in range(40)], a.core.step_id)
    assert all(host_entry(a.core, x).slot in load.src for x in hashes)
    respond(plan, b.core)
    assert [host_entry(a.core, x).pins for x in hashes] == [0, 0, 0, 0]
    assert b.core.make_stats().kv_tier_hits == {REMOTE: 64}


def test_evacuating_a_worker_releases_its_pins_on_others() -> None:
    pool, (a, b) = make_pool("a", "b")
    placement = Placement(pool, lambda _: None)
    run_to_end(a.core, req("a1", PROMPT, max_tokens=1))
    b1 = req("b1", LONGER)
    b.core.add_request(b1)  # placed on b by hand: a holds PROMPT, so it costs less there
    placement.worker_of[b1.req_id] = b
    assert len(b.core.schedule().kv_loads) == 1
    assert ref_cnts(a.core, PROMPT) == [1, 1, 1, 1]
    survivors = placement.evacuate(b)
    assert survivors == [b1] and b1.req_id not in placement
    assert ref_cnts(a.core, PROMPT) == [0, 0, 0, 0]
    assert len(b.core.loads) == 0
