"""Lower KV tiers as a scheduling core indexes them: the copies its plans carry (checked by
executing them in order on dicts), LRU spills, pins and lost slots; and the write-through of
freed prefix blocks by a Scheduler with tiers."""

from __future__ import annotations

from typing import Any, NoReturn

from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler.kv_loads import BlockSource, find_sources
from services.scheduler.kv_tiers import LowerTiers
from services.scheduler.request import Request
from services.scheduler.scheduler import RequestOutput, Scheduler, plan_has_work
from shared.config import SchedulerConfig
from shared.prefix_hash import iter_block_hashes
from shared.sampling_params import SamplingParams
from shared.wire import KV_DEVICE, KV_DISK, KV_HOST, BatchPlan, KVCopy, KVLoad, ModelRunnerOutput

BLOCK = 16
EOS = 2


# ---- helpers (shared with test_kv_loads.py) ----------------------------------------------


def make_scheduler(
    num_blocks: int = 8,
    host: int = 32,
    disk: int = 0,
    *,
    budget: int = 256,
    max_seqs: int = 8,
    block_bytes: int = 1000,
    tiers: bool = True,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_batched_tokens=budget,
        max_num_seqs=max_seqs,
        max_model_len=num_blocks * BLOCK,
        block_size=BLOCK,
        enable_prefix_caching=True,
    )
    return Scheduler(
        config,
        num_blocks,
        eos_token_ids=(EOS,),
        tiers=LowerTiers(host, disk) if tiers else None,
        kv_block_bytes=block_bytes,
    )


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def req(req_id: str, token_ids: list[int], max_tokens: int = 8, **kw: Any) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)
    return Request(req_id, list(token_ids), params)


def hashes_of(token_ids: list[int]) -> list[bytes]:
    return list(iter_block_hashes(token_ids, BLOCK))


def respond(
    plan: BatchPlan,
    sched: Scheduler,
    *,
    token: int = 7,
    report_loads: bool = True,
    fail_loads: bool = False,
    lost: dict[str, list[int]] | None = None,
) -> list[RequestOutput]:
    """Fake worker: one token for every request whose computed tokens reached its length;
    the plan's loads reported done (or failed), unless `report_loads` is False."""
    ids, sampled = [], []
    for req_id in plan.num_scheduled_tokens:
        r = sched.requests.get(req_id)
        ids.append(req_id)
        sampled.append([token] if r is not None and r.num_computed_tokens >= r.num_tokens else [])
    load_ids = [load.load_id for load in plan.kv_loads] if report_loads else []
    return sched.update(
        ModelRunnerOutput(
            step_id=plan.step_id,
            req_ids=ids,
            sampled_token_ids=sampled,
            kv_loads_done=[] if fail_loads else load_ids,
            kv_loads_failed=load_ids if fail_loads else [],
            kv_load_bytes=len(load_ids) * sched.kv_block_bytes,
            kv_load_s=0.001 if load_ids else 0.0,
            kv_lost=lost or {},
        )
    )


def run_to_end(sched: Scheduler, *requests: Request) -> None:
    """Run `requests` (and whatever else is unfinished) to completion."""
    for request in requests:
        sched.add_request(request)
    for _ in range(100):
        if not sched.has_unfinished():
            return
        respond(sched.schedule(), sched)
    raise AssertionError(f"unfinished: {sched.unfinished_requests()}")


def evict_device(sched: Scheduler, start: int = 5000) -> None:
    """Run a request that takes every device block, so no earlier prefix stays cached there."""
    run_to_end(sched, req(f"fill{start}", tokens(start, sched.kv.num_blocks * BLOCK - 1), 1))
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def device_contents(sched: Scheduler) -> dict[int, bytes]:
    """What each device block holds, as the scheduler's index says."""
    return {b.block_id: b.block_hash for b in sched.kv.pool.blocks if b.block_hash is not None}


def execute(
    copies: list[KVCopy],
    device: dict[int, bytes],
    host: dict[int, bytes],
    disk: dict[int, bytes],
) -> None:
    """Run a plan's copies in order, as the worker does, on dicts of block/slot -> hash."""
    tiers = {KV_DEVICE: device, KV_HOST: host, KV_DISK: disk}
    for copy in copies:
        assert len(copy.src) == len(copy.dst), copy
        src, dst = tiers[copy.src_tier], tiers[copy.dst_tier]
        for s, d in zip(copy.src, copy.dst, strict=True):
            dst[d] = src[s]


def assert_index_matches(tiers: LowerTiers, host: dict[int, bytes], disk: dict[int, bytes]) -> None:
    """Every block the index places in a slot is there after the copies ran."""
    for index, sim in ((tiers.host, host), (tiers.disk, disk)):
        for block_hash in index.hashes():
            entry = index.get(block_hash)
            assert entry is not None
            assert sim.get(entry.slot) == block_hash, (index.tier, entry.slot)


def moves(copies: list[KVCopy]) -> list[tuple[str, int, str, int]]:
    """The block moves of `copies` in order, however they are grouped."""
    return [
        (c.src_tier, src, c.dst_tier, dst)
        for c in copies
        for src, dst in zip(c.src, c.dst, strict=True)
    ]


def h(i: int) -> bytes:
    return f"block-{i}".encode()


# ---- TierIndex / LowerTiers --------------------------------------------------------------


def test_offload_writes_freed_blocks_to_host_in_one_merged_copy() -> None:
    tiers = LowerTiers(8, 0)
    assert tiers.enabled and not LowerTiers(0, 8).enabled
    tiers.offload([(5, h(1)), (6, h(2)), (7, h(3))], step=3)
    assert tiers.take_copies() == [KVCopy(KV_DEVICE, KV_HOST, [5, 6, 7], [0, 1, 2])]
    assert tiers.take_copies() == []  # taken once
    entries = [tiers.host.get(h(i)) for i in (1, 2, 3)]
    slots = [(e.slot, e.ready_step, e.pins) for e in entries if e]
    assert slots == [(0, 3, 0), (1, 3, 0), (2, 3, 0)]
    assert len(tiers.host) == 3 and len(tiers.disk) == 0


def test_a_held_hash_is_only_touched() -> None:
    tiers = LowerTiers(2, 0)
    tiers.offload([(0, h(0)), (1, h(1))], step=0)
    tiers.take_copies()
    tiers.offload([(5, h(0))], step=1)  # held: no copy, but now the most recently used
    assert tiers.take_copies() == []
    tiers.offload([(6, h(2))], step=2)  # so h(1) is the one evicted
    assert tiers.take_copies() == [KVCopy(KV_DEVICE, KV_HOST, [6], [1])]
    assert h(1) not in tiers.host and tiers.lookup(h(1)) is None
    assert (tiers.host.get(h(0)) or _missing()).slot == 0
    assert (tiers.host.get(h(2)) or _missing()).slot == 1


def _missing() -> NoReturn:
    raise AssertionError("not in the tier")


def test_a_full_host_tier_spills_its_lru_block_to_disk_before_reusing_the_slot() -> None:
    tiers = LowerTiers(2, 4)
    host: dict[int, bytes] = {}
    disk: dict[int, bytes] = {}
    tiers.offload([(0, h(0)), (1, h(1))], step=0)
    execute(tiers.take_copies(), {0: h(0), 1: h(1)}, host, disk)
    assert host == {0: h(0), 1: h(1)}
    # one plan, several offloads: host slot 0 is reused twice, by h(2) and then by h(4)
    tiers.offload([(2, h(2))], step=1)
    tiers.offload([(3, h(3))], step=1)
    tiers.offload([(4, h(4))], step=1)
    copies = tiers.take_copies()
    assert copies == [
        KVCopy(KV_HOST, KV_DISK, [0], [0]),  # h(0) leaves slot 0 before h(2) lands there
        KVCopy(KV_DEVICE, KV_HOST, [2], [0]),
        KVCopy(KV_HOST, KV_DISK, [1], [1]),
        KVCopy(KV_DEVICE, KV_HOST, [3], [1]),
        KVCopy(KV_HOST, KV_DISK, [0], [2]),  # h(2), written earlier in this plan
        KVCopy(KV_DEVICE, KV_HOST, [4], [0]),
    ]
    # the device blocks of the first plan hold other KV by now (write-through)
    execute(copies, {0: b"other", 1: b"other", 2: h(2), 3: h(3), 4: h(4)}, host, disk)
    assert host == {0: h(4), 1: h(3)}
    assert disk == {0: h(0), 1: h(1), 2: h(2)}
    assert_index_matches(tiers, host, disk)
    assert sorted(tiers.disk.hashes()) == sorted([h(0), h(1), h(2)])
    assert [tiers.tier_of(e) for e in map(tiers.lookup, (h(0), h(4))) if e] == [KV_DISK, KV_HOST]


def test_the_disk_tier_drops_its_lru_block_and_a_block_on_disk_is_not_spilled_again() -> None:
    tiers = LowerTiers(1, 2)
    host: dict[int, bytes] = {}
    disk: dict[int, bytes] = {}
    device = {i: h(i) for i in range(6)}
    for i in range(4):  # h(0) .. h(2) spill in turn; the disk keeps the last two
        tiers.offload([(i, h(i))], step=i)
        execute(tiers.take_copies(), device, host, disk)
    assert tiers.lookup(h(0)) is None
    assert sorted(tiers.disk.hashes()) == sorted([h(1), h(2)]) and list(tiers.host.hashes()) == [
        h(3)
    ]
    assert_index_matches(tiers, host, disk)
    tiers.offload([(2, h(2))], step=4)  # back to host from the device: h(3) spills
    tiers.offload([(3, h(3))], step=4)  # h(2) leaves host again, but disk holds it: no spill
    copies = tiers.take_copies()
    assert [(c.src_tier, c.dst_tier) for c in copies].count((KV_HOST, KV_DISK)) == 1
    execute(copies, device, host, disk)
    assert_index_matches(tiers, host, disk)


def test_one_copy_never_writes_a_slot_twice() -> None:
    """A KVCopy is one gather/scatter on the worker (a CPU host pool stores it with one
    `index_copy_`, whose result is undefined for repeated indices): a slot written twice in
    one copy is at best a wasted write, at worst the wrong block."""
    tiers = LowerTiers(2, 0)  # no disk: an evicted host block is not spilled
    tiers.offload([(3, h(3)), (2, h(2)), (1, h(1)), (0, h(0))], step=0)
    copies = tiers.take_copies()
    host: dict[int, bytes] = {}
    execute(copies, {i: h(i) for i in range(4)}, host, {})
    assert_index_matches(tiers, host, {})  # in-order execution is right ...
    for copy in copies:  # ... but the batched one must be too
        assert len(set(copy.dst)) == len(copy.dst), copy


def test_pinned_slots_are_never_evicted() -> None:
    tiers = LowerTiers(2, 0)
    tiers.offload([(0, h(0)), (1, h(1))], step=0)
    tiers.take_copies()
    (pin0,) = find_sources(tiers, None, [h(0)])
    assert (pin0.tier, pin0.index, pin0.origin) == (KV_HOST, 0, KV_HOST)
    tiers.offload([(2, h(2))], step=1)  # h(1) goes (reading h(0) made it the most recent)
    tiers.offload([(3, h(3))], step=1)  # h(0) is the least recent now, but pinned: h(2) goes
    assert moves(tiers.take_copies()) == [(KV_DEVICE, 2, KV_HOST, 1), (KV_DEVICE, 3, KV_HOST, 1)]
    assert h(0) in tiers.host and h(3) in tiers.host
    (pin3,) = find_sources(tiers, None, [h(3)])
    tiers.offload([(4, h(4))], step=2)  # every slot is being read
    assert tiers.take_copies() == [] and h(4) not in tiers.host
    pin0.release()
    tiers.offload([(4, h(4))], step=3)
    assert tiers.take_copies() == [KVCopy(KV_DEVICE, KV_HOST, [4], [0])]
    assert h(3) in tiers.host
    pin3.release()
    assert all(e.pins == 0 for e in map(tiers.lookup, (h(3), h(4))) if e)


def test_lost_slots_are_dropped_and_a_pinned_one_returns_after_unpin() -> None:
    tiers = LowerTiers(2, 0)
    tiers.offload([(0, h(0)), (1, h(1))], step=0)
    tiers.take_copies()
    (pin,) = find_sources(tiers, None, [h(0)])
    assert tiers.lost(KV_HOST, [0, 1, 7]) == 2
    assert tiers.lost(KV_DISK, [0]) == 0 and tiers.lost(KV_DEVICE, [0]) == 0
    assert tiers.lookup(h(0)) is None and tiers.lookup(h(1)) is None and len(tiers.host) == 0
    tiers.offload([(2, h(2))], step=1)
    tiers.offload([(3, h(3))], step=1)  # slot 0 is still being read: h(2) is evicted instead
    assert moves(tiers.take_copies()) == [(KV_DEVICE, 2, KV_HOST, 1), (KV_DEVICE, 3, KV_HOST, 1)]
    pin.release()
    tiers.offload([(4, h(4))], step=2)
    assert tiers.take_copies() == [KVCopy(KV_DEVICE, KV_HOST, [4], [0])]
    assert sorted(tiers.host.hashes()) == sorted([h(3), h(4)])


def test_a_lost_pinned_slot_is_not_reused_for_a_block_of_the_same_hash() -> None:
    tiers = LowerTiers(1, 0)
    tiers.offload([(0, h(0))], step=0)
    tiers.take_copies()
    (pin,) = find_sources(tiers, None, [h(0)])
    tiers.lost(KV_HOST, [0])
    tiers.offload([(5, h(0))], step=1)  # the only slot is being read
    assert tiers.take_copies() == [] and tiers.lookup(h(0)) is None
    pin.release()
    taken = tiers.host.insert(h(9), step=2)
    assert taken is not None and taken[0].slot == 0
    assert taken[1] is None  # a free slot, not an eviction


@settings(max_examples=150, deadline=None)
@given(
    st.integers(1, 4),
    st.integers(0, 5),
    st.lists(
        st.lists(
            st.one_of(
                st.tuples(st.just("offload"), st.lists(st.integers(0, 11), max_size=5)),
                st.tuples(st.just("pin"), st.lists(st.integers(0, 11), min_size=1, max_size=3)),
                st.tuples(st.just("release"), st.lists(st.integers(0, 20), max_size=1)),
                st.tuples(st.sampled_from([KV_HOST, KV_DISK]), st.lists(st.integers(0, 5))),
            ),
            max_size=6,
        ),
        min_size=1,
        max_size=8,
    ),
)
def test_property_copies_executed_in_order_leave_the_tiers_as_indexed(
    num_host: int,
    num_disk: int,
    plans: list[list[tuple[str, list[int]]]],
) -> None:
    """Plans of offloads, pins (prefix loads), releases and lost slots: after each plan's
    copies ran in order, every indexed block is in its slot, and no copy writes a slot that
    was being read when the copy was planned."""
    tiers = LowerTiers(num_host, num_disk)
    host: dict[int, bytes] = {}
    disk: dict[int, bytes] = {}
    reading: list[tuple[BlockSource, str, int]] = []  # pinned source, tier, slot
    for step, ops in enumerate(plans):
        device: dict[int, bytes] = {}
        copies: list[KVCopy] = []
        # lost slots come with a result, before the next plan is built
        for op, args in sorted(ops, key=lambda o: o[0] not in (KV_HOST, KV_DISK)):
            if op == "offload":
                # freed blocks of this plan, each a device block of its own
                blocks = [(len(device) + i, h(a)) for i, a in enumerate(dict.fromkeys(args))]
                device.update(blocks)
                tiers.offload(blocks, step)
                busy = {(tier, slot) for _, tier, slot in reading}
                for copy in tiers.take_copies():
                    assert not busy & {(copy.dst_tier, d) for d in copy.dst}, (copy, busy)
                    copies.append(copy)
            elif op == "pin":
                for source in find_sources(tiers, None, [h(a) for a in args]):
                    reading.append((source, source.tier, source.index))
            elif op == "release":
                for i in args:
                    if i < len(reading):
                        reading.pop(i)[0].release()
            else:
                sim = host if op == KV_HOST else disk
                dropped = tiers.lost(op, args)
                held = [e for e in map(tiers.tier(op).get, map(h, range(12))) if e]
                assert not {e.slot for e in held} & set(args)
                assert dropped <= len(set(args))
                for slot in args:
                    sim[slot] = b"lost"
        execute(copies, device, host, disk)
        assert_index_matches(tiers, host, disk)
        assert len(tiers.host) <= num_host and len(tiers.disk) <= (num_disk if num_host else 0)
    for source, _, _ in reading:
        source.release()
    entries = [tiers.lookup(h(a)) for a in range(12)]
    assert all(e.pins == 0 for e in entries if e)


# ---- a Scheduler with tiers --------------------------------------------------------------


def test_a_finished_request_is_offloaded_by_the_next_plan() -> None:
    s = make_scheduler()
    prompt = tokens(100, 64)
    s.add_request(req("a", prompt, max_tokens=1))
    plan = s.schedule()
    assert plan.kv_copies == []
    respond(plan, s)
    assert not s.has_unfinished()
    device = device_contents(s)
    plan = s.schedule()
    assert plan.finished_req_ids == ["a"]
    # tail first: the head of the prefix is the most recently used
    assert plan.kv_copies == [KVCopy(KV_DEVICE, KV_HOST, [3, 2, 1, 0], [0, 1, 2, 3])]
    host: dict[int, bytes] = {}
    execute(plan.kv_copies, device, host, {})
    assert sorted(host.values()) == sorted(hashes_of(prompt))
    assert_index_matches(s.kv.tiers, host, {})
    stats = s.make_stats()
    assert stats.kv_tier_blocks == {KV_HOST: 32, KV_DISK: 0}
    assert stats.kv_tier_used_blocks == {KV_HOST: 4, KV_DISK: 0}
    assert set(hashes_of(prompt)) <= set(s.kv.resident_block_hashes())
    assert s.schedule().kv_copies == []  # once


def test_blocks_still_held_by_a_request_are_not_offloaded() -> None:
    s = make_scheduler()
    prompt = tokens(100, 64)
    s.add_request(req("a", prompt, max_tokens=1))
    s.add_request(req("b", [*prompt, 1, 2, 3], max_tokens=4))
    respond(s.schedule(), s)  # a finishes; b shares its four blocks and runs on
    plan = s.schedule()
    assert plan.finished_req_ids == ["a"] and plan.kv_copies == []
    assert len(s.kv.tiers.host) == 0


def test_the_head_of_a_prefix_stays_in_host_longest() -> None:
    s = make_scheduler(host=2, disk=2)
    prompt = tokens(100, 64)
    s.add_request(req("a", prompt, max_tokens=1))
    respond(s.schedule(), s)
    device = device_contents(s)
    plan = s.schedule()
    host: dict[int, bytes] = {}
    disk: dict[int, bytes] = {}
    execute(plan.kv_copies, device, host, disk)
    hashes = hashes_of(prompt)
    assert sorted(s.kv.tiers.host.hashes()) == sorted(hashes[:2])
    assert sorted(s.kv.tiers.disk.hashes()) == sorted(hashes[2:])
    assert sorted(host.values()) == sorted(hashes[:2])
    assert sorted(disk.values()) == sorted(hashes[2:])
    assert_index_matches(s.kv.tiers, host, disk)


def test_a_preempted_request_is_offloaded_by_the_plan_that_preempts_it() -> None:
    s = make_scheduler()
    s.add_request(req("x", tokens(100, 64), max_tokens=2))
    s.add_request(req("y", tokens(300, 64), max_tokens=8))
    respond(s.schedule(), s)  # both take four blocks: the pool is full
    device = device_contents(s)
    plan = s.schedule()  # x needs a fifth block: y goes
    assert plan.preempted_req_ids == ["y"]
    assert plan.kv_copies == [KVCopy(KV_DEVICE, KV_HOST, [7, 6, 5, 4], [0, 1, 2, 3])]
    host: dict[int, bytes] = {}
    execute(plan.kv_copies, device, host, {})  # before the forward pass reuses block 7
    assert sorted(host.values()) == sorted(hashes_of(tokens(300, 64)))
    entries = [s.kv.tiers.host.get(x) for x in hashes_of(tokens(300, 64))]
    assert [e.ready_step for e in entries if e] == [plan.step_id] * 4


def test_slots_of_a_finished_request_are_ready_at_the_plan_carrying_their_copies() -> None:
    """`TierSlot.ready_step` is the plan whose copies write the slot (another worker may read
    it once that plan's result came back): for a request finished by a result, the next plan."""
    s = make_scheduler()
    prompt = tokens(100, 64)
    s.add_request(req("a", prompt, max_tokens=1))
    respond(s.schedule(), s)  # result of plan 0: a finishes, its blocks are freed
    plan = s.schedule()
    assert plan.step_id == 1 and len(plan.kv_copies) == 1
    entries = [s.kv.tiers.host.get(x) for x in hashes_of(prompt)]
    assert [e.ready_step for e in entries if e] == [plan.step_id] * 4


def test_slots_of_an_aborted_request_are_ready_at_the_plan_carrying_their_copies() -> None:
    s = make_scheduler()
    prompt = tokens(100, 64)
    s.add_request(req("a", prompt, max_tokens=8))
    respond(s.schedule(), s)
    s.abort(["a"])
    plan = s.schedule()
    assert plan.finished_req_ids == ["a"] and len(plan.kv_copies) == 1
    entries = [s.kv.tiers.host.get(x) for x in hashes_of(prompt)]
    assert [e.ready_step for e in entries if e] == [plan.step_id] * 4


def test_kv_lost_drops_slots_and_counts_them() -> None:
    s = make_scheduler()
    prompt = tokens(100, 64)
    run_to_end(s, req("a", prompt, max_tokens=1))
    evict_device(s)
    hashes = hashes_of(prompt)
    slot = (s.kv.tiers.host.get(hashes[1]) or _missing()).slot
    assert s.num_uncached_blocks(prompt) == 0
    plan = s.schedule()
    respond(plan, s, lost={KV_HOST: [slot]})
    assert s.kv.tiers.lookup(hashes[1]) is None
    assert s.kv.tiers.lookup(hashes[0]) is not None and s.kv.tiers.lookup(hashes[2]) is not None
    assert s.make_stats().kv_tier_blocks_lost == 1
    assert s.num_uncached_blocks(prompt) == 3  # the chain breaks at the lost block


def test_num_uncached_blocks_counts_lower_tier_blocks_as_cached() -> None:
    prompt = tokens(100, 64)
    longer = [*prompt, *tokens(900, 20)]  # five full blocks, four of them a's
    with_tiers, without = make_scheduler(), make_scheduler(tiers=False)
    for s in (with_tiers, without):
        assert s.num_uncached_blocks(longer) == 5
        run_to_end(s, req("a", prompt, max_tokens=1))
        assert s.num_uncached_blocks(longer) == 1  # on the device still
        evict_device(s)
    assert with_tiers.num_uncached_blocks(longer) == 1  # host
    assert without.num_uncached_blocks(longer) == 5


def test_a_plan_with_only_copies_or_loads_has_work() -> None:
    assert not plan_has_work(BatchPlan(step_id=0))
    copy = KVCopy(KV_DEVICE, KV_HOST, [0], [0])
    assert plan_has_work(BatchPlan(step_id=0, kv_copies=[copy]))
    load = KVLoad(load_id=0, block_ids=[0], src_tier=KV_HOST, src=[0])
    assert plan_has_work(BatchPlan(step_id=0, kv_loads=[load]))
