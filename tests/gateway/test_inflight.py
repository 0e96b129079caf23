"""In-flight requests over several scheduler shards, against a scripted transport (no NATS):
placement, per-shard aborts, per-shard moves and orphans."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from services.gateway.inflight import InFlightRequests
from services.gateway.request_stream import EngineError
from services.gateway.shards import Shards
from shared.prefix_hash import iter_block_hashes
from shared.prefix_summary import build
from shared.wire import (
    OutputBatch,
    SamplingParams,
    SchedulerHeartbeat,
    SubmitReply,
    SubmitRequest,
    TokenDelta,
)

pytestmark = pytest.mark.anyio


class FakeTransport:
    """Records submits and aborts per shard; `replies[shard]` answers that shard's submits."""

    def __init__(self, num_shards: int) -> None:
        self.shards = Shards("p", num_shards, heartbeat_timeout=3.0)
        for shard in self.shards:
            shard.heartbeat(SchedulerHeartbeat(epoch="e", num_ready_workers=1))
        self.replies = {i: SubmitReply(accepted=True) for i in range(num_shards)}
        self.submits: list[tuple[int, str]] = []
        self.requests: dict[str, SubmitRequest] = {}
        self.aborts: list[tuple[int, list[str]]] = []
        self.gate: asyncio.Event | None = None  # when set, submits wait for it

    async def submit(self, shard: int, request: SubmitRequest) -> SubmitReply:
        self.submits.append((shard, request.req_id))
        self.requests[request.req_id] = request
        if self.gate is not None:
            await self.gate.wait()
        return self.replies[shard]

    async def abort(self, shard: int, engine_ids: list[str]) -> None:
        self.aborts.append((shard, engine_ids))


def _request(req_id: str) -> SubmitRequest:
    return SubmitRequest(
        req_id=req_id, gateway_id="gw", prompt_token_ids=[1], sampling_params=SamplingParams()
    )


def _inflight(transport: FakeTransport) -> InFlightRequests:
    return InFlightRequests(transport, orphan_timeout=60.0, resubmit_timeout=5.0)


async def _until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_requests_spread_over_the_shards_by_load():
    transport = FakeTransport(3)
    transport.shards[0].num_running = 1  # shard 0 starts one request ahead
    requests = _inflight(transport)
    for i in range(5):
        await requests.submit(_request(f"r{i}"))
    assert transport.submits == [(1, "r0"), (2, "r1"), (0, "r2"), (1, "r3"), (2, "r4")]
    assert requests.stats.submitted == 5


async def test_new_and_moved_requests_go_to_the_shard_holding_their_prefix():
    transport = FakeTransport(3)
    prompt, output = list(range(64)), list(range(100, 132))
    for shard, held in ((0, [7] * 16), (1, prompt), (2, prompt + output)):
        summary = build(iter_block_hashes(held, 16))
        beat = SchedulerHeartbeat(
            epoch="e", num_ready_workers=1, block_size=16, prefix_summary=summary
        )
        transport.shards.heartbeat(shard, beat)
    requests = _inflight(transport)
    request = SubmitRequest(
        req_id="a", gateway_id="gw", prompt_token_ids=prompt, sampling_params=SamplingParams()
    )
    await requests.submit(request)
    assert transport.submits == [(1, "a")]  # its whole prompt on 1 and 2: the lower index
    await requests.deliver(OutputBatch(deltas=[TokenDelta(req_id="a", new_token_ids=output)]))
    requests.move("shard 1 restarted", shard=1)
    await _until(lambda: len(transport.submits) == 2)
    assert transport.submits[1] == (2, "a.1")  # the only one holding its output's blocks too
    shards = transport.shards
    assert [s.routed["prefix"] for s in shards] == [0, 1, 1]
    assert [s.matched_tokens for s in shards] == [0, 64, 96]


async def test_a_full_shard_hands_a_new_request_to_another_once():
    transport = FakeTransport(3)
    transport.replies[0] = SubmitReply(accepted=False, status=429, message="full")
    requests = _inflight(transport)
    await requests.submit(_request("a"))
    assert transport.submits == [(0, "a"), (1, "a")]
    await requests.abort(["a"])
    assert transport.aborts == [(1, ["a"])]  # aborted where it is held

    transport.replies[1] = transport.replies[2] = transport.replies[0]
    with pytest.raises(EngineError) as err:
        await requests.submit(_request("b"))
    assert (err.value.status, err.value.message) == (429, "full")
    assert [shard for shard, req_id in transport.submits if req_id == "b"] == [2, 0]
    assert len(requests) == 0 and requests.stats.rejected == 3


async def test_a_bad_request_is_not_tried_on_another_shard():
    transport = FakeTransport(2)
    transport.replies[0] = SubmitReply(accepted=False, status=400, message="bad")
    with pytest.raises(EngineError) as err:
        await _inflight(transport).submit(_request("a"))
    assert err.value.status == 400 and transport.submits == [(0, "a")]


async def test_aborts_go_to_the_shards_that_hold_the_requests():
    transport = FakeTransport(2)
    requests = _inflight(transport)
    for req_id in ("a", "b", "c"):
        await requests.submit(_request(req_id))
    await requests.abort(["a", "b", "c", "unknown"])
    assert sorted(transport.aborts) == [(0, ["a", "c"]), (1, ["b"])]
    assert len(requests) == 0 and requests.stats.aborted == 3


async def test_a_restarted_shard_moves_only_its_own_requests():
    transport = FakeTransport(2)
    requests = _inflight(transport)
    streams = {r: await requests.submit(_request(r)) for r in ("a", "b", "c", "d")}
    await requests.deliver(
        OutputBatch(deltas=[TokenDelta(req_id=r, new_token_ids=[7]) for r in streams])
    )
    transport.submits.clear()
    requests.move("shard 1 restarted", shard=1)  # b and d were there
    await _until(lambda: len(transport.submits) == 2)
    assert sorted(req_id for _, req_id in transport.submits) == ["b.1", "d.1"]
    assert sorted(transport.aborts) == [(1, ["b"]), (1, ["d"])]
    assert transport.requests["b.1"].output_token_ids == [7]
    assert requests.stats.migrated == 2

    # deltas of the old ids are dropped, the new and untouched ones reach their streams
    finish = [TokenDelta(req_id=r, new_token_ids=[8], finish_reason="stop") for r in "abcd"]
    finish += [
        TokenDelta(req_id=r, new_token_ids=[9], finish_reason="stop") for r in ("b.1", "d.1")
    ]
    await requests.deliver(OutputBatch(deltas=finish))
    assert len(requests) == 0
    for req_id, stream in streams.items():
        tokens = [t async for delta in stream for t in delta.new_token_ids]
        assert tokens == ([7, 9] if req_id in ("b", "d") else [7, 8])


async def test_our_reconnection_moves_every_request():
    transport = FakeTransport(2)
    requests = _inflight(transport)
    for req_id in ("a", "b"):
        await requests.submit(_request(req_id))
    requests.move("reconnected to NATS")
    await _until(lambda: len(transport.submits) == 4)
    assert sorted(transport.aborts) == [(0, ["a"]), (1, ["b"])]
    assert {req_id for _, req_id in transport.submits[2:]} == {"a.1", "b.1"}


async def test_a_request_accepted_while_its_shard_restarts_moves_afterwards():
    transport = FakeTransport(2)
    requests = _inflight(transport)
    transport.gate = asyncio.Event()
    submitting = asyncio.ensure_future(requests.submit(_request("a")))
    await _until(lambda: len(transport.submits) == 1)
    requests.move("shard 1 restarted", shard=1)  # not a's shard
    requests.move("shard 0 restarted", shard=0)
    transport.gate.set()
    await submitting
    await _until(lambda: len(transport.submits) == 2)
    assert transport.submits[1][1] == "a.1" and transport.aborts == [(0, ["a"])]


async def test_only_the_requests_of_a_silent_shard_fail():
    transport = FakeTransport(2)
    requests = _inflight(transport)
    stream_a = await requests.submit(_request("a"))
    stream_b = await requests.submit(_request("b"))
    transport.shards[1].last_heartbeat -= 61  # silent for longer than orphan_timeout
    requests.fail_orphans()
    with pytest.raises(EngineError) as err:
        await anext(stream_b)
    assert err.value.status == 503
    assert len(requests) == 1 and requests.stats.failed == 1
    await requests.deliver(OutputBatch(deltas=[TokenDelta(req_id="a", finish_reason="stop")]))
    assert (await anext(stream_a)).finish_reason == "stop"


async def test_a_request_the_scheduler_failed_fails_its_stream_with_422():
    transport = FakeTransport(1)
    requests = _inflight(transport)
    stream_a = await requests.submit(_request("a"))
    stream_b = await requests.submit(_request("b"))
    tokens = [TokenDelta(req_id=r, new_token_ids=[7]) for r in ("a", "b")]
    await requests.deliver(OutputBatch(deltas=tokens))
    error = TokenDelta(req_id="a", finish_reason="error", error="it hangs workers")
    await requests.deliver(OutputBatch(deltas=[error]))
    assert (await anext(stream_a)).new_token_ids == [7]  # what came before still streams
    with pytest.raises(EngineError) as err:
        await anext(stream_a)
    assert (err.value.status, err.value.message) == (422, "it hangs workers")
    assert len(requests) == 1 and requests.stats.failed == 1
    await requests.deliver(OutputBatch(deltas=[TokenDelta(req_id="b", finish_reason="stop")]))
    assert [d.finish_reason async for d in stream_b] == [None, "stop"]
