"""Prefill/decode disaggregation in the scheduler: placement by role, the hand-over after the
first token, the decode worker's fetch of the prompt's blocks from the prefill worker (in
chunks, held on the prefill worker until it lands), and its fallbacks: recompute after a
failed fetch, decode on the prefill worker when no decode worker is there."""

from __future__ import annotations

import msgspec
import pytest

from services.scheduler.handoff import LOCAL, RECOMPUTED, TRANSFERRED, Handoff
from services.scheduler.placement import Placement
from services.scheduler.request import Request, RequestStatus
from services.scheduler.scheduler import RequestOutput
from services.scheduler.worker_pool import WorkerHandle, WorkerPool
from shared.config import SchedulerConfig
from shared.sampling_params import SamplingParams
from shared.wire import KV_DEVICE, ROLE_DECODE, ROLE_MIXED, ROLE_PREFILL, BatchPlan
from tests.scheduler.fakes import unpaced_config
from tests.scheduler.test_kv_loads import device_block_ids, hello_of, ref_cnts
from tests.scheduler.test_kv_tiers import respond, tokens

BLOCK_BYTES = 4096
LONG = tokens(100, 70)  # four full blocks and 6 tokens: past the threshold of 32
SHORT = tokens(500, 20)


class Fleet:
    """A pool of workers of the given roles with a placement, and a fake driver loop: each
    `step` plans, answers with one token per sampling request and hands off what is ready."""

    def __init__(self, *roles: str, threshold: int = 32, num_blocks: int = 8) -> None:
        config = unpaced_config(max_num_batched_tokens=256, disaggregation_threshold=threshold)
        self.pool = WorkerPool(config)
        self.workers: list[WorkerHandle] = []
        for i, role in enumerate(roles):
            hello = msgspec.structs.replace(
                hello_of(f"{role}-{i}", block_bytes=BLOCK_BYTES), role=role, num_blocks=num_blocks
            )
            self.workers.append(self.pool.register(hello)[0])
        self.landed: list[tuple[str, int]] = []  # (outcome, bytes)
        self.placement = Placement(self.pool, lambda _wid: None, self.on_landed)
        self.outputs: dict[str, list[int]] = {}

    def on_landed(self, handoff: Handoff, num_bytes: int) -> None:
        self.landed.append((handoff.outcome(num_bytes), num_bytes))

    def step(self, worker: WorkerHandle, *, fail_loads: bool = False) -> BatchPlan:
        plan = worker.core.schedule()
        self.collect(respond(plan, worker.core, fail_loads=fail_loads))
        for request in worker.core.hand_off_ready():
            self.placement.hand_off(worker, request)
        return plan

    def collect(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self.outputs.setdefault(out.req_id, []).extend(out.new_token_ids)

    def run(self, steps: int = 30) -> None:
        for _ in range(steps):
            for worker in self.workers:
                self.step(worker)


def req(req_id: str, token_ids: list[int], max_tokens: int = 4, **kw: object) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)  # type: ignore[arg-type]
    return Request(req_id, list(token_ids), params)


def test_long_prompts_go_to_prefill_workers_and_short_ones_to_decode_workers() -> None:
    fleet = Fleet(ROLE_PREFILL, ROLE_DECODE)
    prefill, decode = fleet.workers
    long, short = req("long", LONG), req("short", SHORT)
    fleet.placement.place(long)
    fleet.placement.place(short)
    assert fleet.placement.worker_of == {"long": prefill, "short": decode}
    assert long.prefill_only and not short.prefill_only


def test_long_prefills_are_not_paced_on_prefill_workers() -> None:
    pool = WorkerPool(SchedulerConfig(long_prefill_step_time=0.5, long_prefill_share=0.5))
    roles = (ROLE_PREFILL, ROLE_DECODE, ROLE_MIXED)
    hellos = [msgspec.structs.replace(hello_of(role), role=role) for role in roles]
    prefill, decode, mixed = (pool.register(hello)[0] for hello in hellos)
    assert not prefill.core.pacer.enabled  # nothing decodes there to protect
    assert decode.core.pacer.enabled and mixed.core.pacer.enabled


def test_what_stays_colocated() -> None:
    fleet = Fleet(ROLE_PREFILL, ROLE_DECODE)
    _, decode = fleet.workers
    logprobs = req("logprobs", LONG, prompt_logprobs=1)  # computed where the prompt runs
    moved = req("moved", LONG)
    moved.append_output_token(9)  # a migrated request with tokens generated
    for request in (logprobs, moved):
        fleet.placement.place(request)
        assert fleet.placement.worker_of[request.req_id] is decode
        assert not request.prefill_only
    # only mixed workers, or no decode worker: nothing is disaggregated
    for roles in ((ROLE_MIXED, ROLE_MIXED), (ROLE_PREFILL,)):
        lone = Fleet(*roles)
        request = req("long", LONG)
        lone.placement.place(request)
        assert not request.prefill_only


def test_the_uncached_part_decides() -> None:
    fleet = Fleet(ROLE_PREFILL, ROLE_DECODE)
    _, decode = fleet.workers
    fleet.placement.place(req("first", SHORT))
    fleet.run()
    # SHORT's first block is cached on the decode worker: 20 + 24 tokens, 28 uncached
    follow_up = req("follow-up", [*SHORT, *tokens(900, 24)])
    fleet.placement.place(follow_up)
    assert fleet.placement.worker_of["follow-up"] is decode and not follow_up.prefill_only


def test_a_hand_over_fetches_the_prompt_from_the_prefill_worker() -> None:
    fleet = Fleet(ROLE_PREFILL, ROLE_DECODE)
    prefill, decode = fleet.workers
    long = req("long", LONG, max_tokens=4)
    fleet.placement.place(long)
    first = prefill.core.schedule()  # the whole prompt in one chunk; it samples
    assert first.num_scheduled_tokens == {"long": len(LONG)}
    assert prefill.core.schedule().num_scheduled_tokens == {}  # it does not decode there
    fleet.collect(respond(first, prefill.core))
    (ready,) = prefill.core.hand_off_ready()
    assert ready is long and not prefill.core.has_unfinished()
    assert ref_cnts(prefill.core, LONG[:64]) == [1, 1, 1, 1]  # held for the fetch
    fleet.placement.hand_off(prefill, ready)
    assert fleet.placement.worker_of["long"] is decode and fleet.outputs["long"] == [7]
    assert prefill.core.schedule().finished_req_ids == ["long"]  # the worker drops it
    fetch = fleet.step(decode)
    (load,) = fetch.kv_loads
    assert (load.src_tier, load.remote_address) == (KV_DEVICE, prefill.hello.kv_transfer_address)
    assert load.src == device_block_ids(prefill.core, LONG[:64])
    assert fetch.num_scheduled_tokens == {}
    decoding = fleet.step(decode)
    # admitted with the four fetched blocks: it computes the 6 tokens after them and its token
    (new,) = decoding.new_reqs
    assert new.num_computed_tokens == 64 and new.output_token_ids == [7]
    assert decoding.num_scheduled_tokens == {"long": 7}
    assert fleet.landed == [(TRANSFERRED, 4 * BLOCK_BYTES)]
    assert ref_cnts(prefill.core, LONG[:64]) == [0, 0, 0, 0]  # released once it landed
    fleet.run()
    assert fleet.outputs["long"] == [7, 7, 7, 7]
    assert decode.core.make_stats().kv_tier_hits == {}  # a hand-over is not a prefix hit


def test_beside_running_decodes_a_prompt_is_fetched_in_chunks_of_the_load_window() -> None:
    fleet = Fleet(ROLE_PREFILL, ROLE_DECODE, num_blocks=16)
    prefill, decode = fleet.workers
    prompt = tokens(100, 150)  # nine full blocks
    decode.core.add_request(req("decoding", SHORT, max_tokens=40))  # steps that must not wait
    fleet.step(decode)
    fleet.placement.place(req("long", prompt, max_tokens=2))
    fleet.step(prefill)
    decode.core.kv_load_bps = 2 * BLOCK_BYTES / 0.02  # two blocks in the minimum window
    first = decode.core.schedule()
    assert [len(load.block_ids) for load in first.kv_loads] == [2]
    respond(first, decode.core)
    chunks: list[int] = []
    while not fleet.landed and len(chunks) < 20:
        decode.core.kv_load_bps = 2 * BLOCK_BYTES / 0.02
        chunks += [len(load.block_ids) for load in fleet.step(decode).kv_loads]
    assert chunks == [2, 2, 2, 1]
    assert fleet.landed == [(TRANSFERRED, 9 * BLOCK_BYTES)]


def test_a_failed_fetch_is_recomputed_on_the_decode_worker() -> None:
    fleet = Fleet(ROLE_PREFILL, ROLE_DECODE)
    prefill, decode = fleet.workers
    fleet.placement.place(req("long", LONG, max_tokens=3))
    fleet.step(prefill)
    assert fleet.step(decode, fail_loads=True).kv_loads
    plan = fleet.step(decode)
    assert plan.num_scheduled_tokens == {"long": len(LONG) + 1} and not plan.kv_loads
    assert fleet.landed == [(RECOMPUTED, 0)]
    assert ref_cnts(prefill.core, LONG[:64]) == [0, 0, 0, 0]
    fleet.run()
    assert fleet.outputs["long"] == [7, 7, 7]


def test_without_a_decode_worker_it_decodes_where_it_was_prefilled() -> None:
    fleet = Fleet(ROLE_PREFILL, ROLE_DECODE)
    prefill, decode = fleet.workers
    fleet.placement.place(req("long", LONG, max_tokens=3))
    decode.healthy = False
    fleet.step(prefill)
    assert fleet.placement.worker_of["long"] is prefill
    plan = fleet.step(prefill)
    (new,) = plan.new_reqs
    assert new.num_computed_tokens == 64 and not plan.kv_loads  # its own cached blocks
    assert fleet.landed == [(LOCAL, 0)]
    fleet.run()
    assert fleet.outputs["long"] == [7, 7, 7]


@pytest.mark.parametrize("end", ["abort", "evacuate"])
def test_a_request_that_ends_before_it_lands_releases_its_blocks(end: str) -> None:
    fleet = Fleet(ROLE_PREFILL, ROLE_DECODE)
    prefill, decode = fleet.workers
    fleet.placement.place(req("long", LONG))
    fleet.step(prefill)
    assert ref_cnts(prefill.core, LONG[:64]) == [1, 1, 1, 1]
    if end == "abort":
        fleet.placement.abort("long")
    else:
        assert [r.req_id for r in fleet.placement.evacuate(decode)] == ["long"]
    assert ref_cnts(prefill.core, LONG[:64]) == [0, 0, 0, 0]
    assert not prefill.core.handed_off and fleet.landed == []


def test_the_decode_worker_waits_for_room_for_the_whole_prompt() -> None:
    fleet = Fleet(ROLE_PREFILL, ROLE_DECODE)
    prefill, decode = fleet.workers
    decode.core.add_request(req("busy", tokens(3000, 80), max_tokens=20))  # 6 of 8 blocks
    fleet.step(decode)
    fleet.placement.place(req("long", LONG))
    fleet.step(prefill)
    plan = fleet.step(decode)
    assert not plan.kv_loads and decode.core.requests["long"].status == RequestStatus.WAITING
    fleet.run()
    assert fleet.outputs["long"] == [7, 7, 7, 7] and fleet.landed == [(TRANSFERRED, 16384)]


def test_a_prefill_only_request_preempted_after_its_first_token_is_handed_off() -> None:
    fleet = Fleet(ROLE_PREFILL, ROLE_DECODE)
    prefill, _ = fleet.workers
    long = req("long", LONG)
    fleet.placement.place(long)
    plan = prefill.core.schedule()
    fleet.collect(respond(plan, prefill.core))
    prefill.core.running.remove(long)
    prefill.core._preempt(long)
    (ready,) = prefill.core.hand_off_ready()
    assert ready is long and not prefill.core.waiting
