"""The NATS engine client against a real nats-server and scripted scheduler shards."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable

import pytest

from services.gateway.config import GatewayConfig
from services.gateway.engine_client import EngineError, NatsEngineClient
from shared import bus
from shared.subjects import Subjects, shard_prefixes
from shared.wire import (
    AbortRequests,
    OutputBatch,
    SamplingParams,
    SchedulerHeartbeat,
    SubmitReply,
    SubmitRequest,
    TokenDelta,
    encode,
)

# ---- NATS engine client -------------------------------------------------------------------


class ScriptedScheduler:
    """A tiny scheduler over NATS: accepts submits, heartbeats, emits tokens on demand."""

    def __init__(self, nc, subjects: Subjects, epoch: str) -> None:
        self.nc, self.subjects, self.epoch = nc, subjects, epoch
        self.submits: list[SubmitRequest] = []
        self.aborts: list[str] = []

    async def start(self) -> None:
        async def on_submit(request: SubmitRequest) -> SubmitReply:
            self.submits.append(request)
            return SubmitReply(accepted=True)

        async def on_abort(abort: AbortRequests) -> None:
            self.aborts.extend(abort.req_ids)

        await bus.serve(self.nc, self.subjects.submit, SubmitRequest, on_submit)
        await bus.subscribe(self.nc, self.subjects.abort, AbortRequests, on_abort)
        await self.heartbeat()

    async def heartbeat(self) -> None:
        beat = SchedulerHeartbeat(epoch=self.epoch, num_ready_workers=1, max_model_len=128)
        await bus.publish(self.nc, self.subjects.scheduler_heartbeat, beat)
        await self.nc.flush()

    async def emit(
        self, gateway_id: str, req_id: str, tokens: list[int], finish: str | None = None
    ) -> None:
        delta = TokenDelta(req_id=req_id, new_token_ids=tokens, finish_reason=finish)
        await bus.publish(self.nc, self.subjects.output(gateway_id), OutputBatch(deltas=[delta]))
        await self.nc.flush()


async def _until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


@pytest.mark.anyio
async def test_nats_engine_client_submit_stream_abort_and_restart(nats_url):
    import nats

    subjects = Subjects("t")
    nc = await nats.connect(nats_url)
    scheduler = ScriptedScheduler(nc, subjects, "epoch-1")
    await scheduler.start()
    client = NatsEngineClient(
        GatewayConfig(nats_url=nats_url, subject_prefix="t", gateway_id="gw1")
    )
    await client.start()
    try:
        await _until(lambda: client.connected)
        await scheduler.heartbeat()
        assert await client.wait_ready(5)
        assert client.max_model_len == 128
        params = SamplingParams(max_tokens=5)
        stream = await client.submit(
            SubmitRequest(
                req_id="r-0", gateway_id="", prompt_token_ids=[1, 2], sampling_params=params
            )
        )
        assert scheduler.submits[0].gateway_id == "gw1"
        await scheduler.emit("gw1", "r-0", [10, 11])
        first = await asyncio.wait_for(anext(stream), 5)
        assert first.new_token_ids == [10, 11]

        # A restarted scheduler (new epoch) gets the request again as a continuation.
        scheduler.epoch = "epoch-2"
        await scheduler.heartbeat()
        await _until(lambda: len(scheduler.submits) == 2)
        moved = scheduler.submits[1]
        assert moved.req_id == "r-0.1" and moved.output_token_ids == [10, 11]
        assert "r-0" in scheduler.aborts
        await scheduler.emit("gw1", "r-0", [99])  # late delta of the old id: dropped
        await scheduler.emit("gw1", "r-0.1", [12], finish="length")
        last = await asyncio.wait_for(anext(stream), 5)
        assert last.new_token_ids == [12] and last.finish_reason == "length"
        assert client.num_in_flight == 0

        stream = await client.submit(
            SubmitRequest(req_id="r-1", gateway_id="", prompt_token_ids=[1], sampling_params=params)
        )
        await client.abort(["r-1"])
        await _until(lambda: "r-1" in scheduler.aborts)
        assert client.num_in_flight == 0
    finally:
        await client.close()
        await nc.close()


@pytest.mark.anyio
async def test_nats_engine_client_not_ready_and_rejections(nats_url):
    import nats

    config = GatewayConfig(
        nats_url=nats_url, subject_prefix="t2", gateway_id="gw2", scheduler_timeout=0.5
    )
    client = NatsEngineClient(config, submit_timeout=0.5)
    request = SubmitRequest(
        req_id="r", gateway_id="", prompt_token_ids=[1], sampling_params=SamplingParams()
    )
    with pytest.raises(EngineError) as err:
        await client.submit(request)
    assert err.value.status == 503
    await client.start()
    nc = await nats.connect(nats_url)
    try:
        await _until(lambda: client.connected)
        assert not client.ready
        subjects = Subjects("t2")

        async def reject(msg):
            await msg.respond(encode(SubmitReply(accepted=False, status=429, message="full")))

        await nc.subscribe(subjects.submit, cb=reject)
        beat = SchedulerHeartbeat(epoch="e", num_ready_workers=1, max_model_len=64)
        await nc.publish(subjects.scheduler_heartbeat, encode(beat))
        assert await client.wait_ready(5)
        with pytest.raises(EngineError) as err:
            await client.submit(request)
        assert (err.value.status, err.value.message) == (429, "full")
        assert client.num_in_flight == 0
    finally:
        await client.close()
        await nc.close()


@pytest.mark.anyio
async def test_nats_engine_client_moves_requests_after_reconnect(nats_server):
    import nats

    subjects = Subjects("t3")
    nc = await nats.connect(
        nats_server.nats_url, max_reconnect_attempts=-1, reconnect_time_wait=0.2
    )
    scheduler = ScriptedScheduler(nc, subjects, "e")
    await scheduler.start()
    client = NatsEngineClient(
        GatewayConfig(nats_url=nats_server.nats_url, subject_prefix="t3", gateway_id="gw3")
    )
    await client.start()
    try:
        await _until(lambda: client.connected)
        await scheduler.heartbeat()
        assert await client.wait_ready(5)
        stream = await client.submit(
            SubmitRequest(
                req_id="r", gateway_id="", prompt_token_ids=[1], sampling_params=SamplingParams()
            )
        )
        await scheduler.emit("gw3", "r", [7])
        assert (await asyncio.wait_for(anext(stream), 5)).new_token_ids == [7]
        nats_server.kill("nats", signal.SIGTERM)  # deltas sent meanwhile are lost: it moves
        nats_server.start_nats()
        await _until(lambda: len(scheduler.submits) == 2, timeout=10)
        assert scheduler.submits[1].req_id == "r.1"
        assert scheduler.submits[1].output_token_ids == [7]
        await scheduler.emit("gw3", "r.1", [8], finish="stop")
        assert (await asyncio.wait_for(anext(stream), 5)).finish_reason == "stop"
    finally:
        await client.close()
        await nc.close()


@pytest.mark.anyio
async def test_nats_engine_client_reassembles_split_output_batches(nats_url):
    import nats

    subjects = Subjects("t4")
    nc = await nats.connect(nats_url)
    scheduler = ScriptedScheduler(nc, subjects, "e")
    await scheduler.start()
    client = NatsEngineClient(
        GatewayConfig(nats_url=nats_url, subject_prefix="t4", gateway_id="gw4")
    )
    await client.start()
    try:
        await _until(lambda: client.connected)
        await scheduler.heartbeat()
        assert await client.wait_ready(5)
        request = SubmitRequest(
            req_id="r", gateway_id="", prompt_token_ids=[1], sampling_params=SamplingParams()
        )
        stream = await client.submit(request)
        tokens = list(range(100_000, 500_000))  # about 2 MiB: split over the 1 MiB limit
        delta = TokenDelta(req_id="r", new_token_ids=tokens, finish_reason="length")
        await bus.publish(nc, subjects.output("gw4"), OutputBatch(deltas=[delta]))
        assert (await asyncio.wait_for(anext(stream), 5)).new_token_ids == tokens
    finally:
        await client.close()
        await nc.close()


@pytest.mark.anyio
async def test_nats_engine_client_spreads_over_shards_and_moves_a_restarted_ones(nats_url):
    import nats

    nc = await nats.connect(nats_url)
    shards = [
        ScriptedScheduler(nc, Subjects(prefix), f"epoch-{i}")
        for i, prefix in enumerate(shard_prefixes("t5", 2))
    ]
    for shard in shards:
        await shard.start()
    client = NatsEngineClient(
        GatewayConfig(nats_url=nats_url, subject_prefix="t5", gateway_id="gw5", scheduler_shards=2)
    )
    await client.start()
    try:
        await _until(lambda: client.connected)
        for shard in shards:
            await shard.heartbeat()
        await _until(lambda: all(client.shards.available(s) for s in client.shards))
        assert client.ready
        params = SamplingParams(max_tokens=5)
        streams = {}
        for i in range(4):  # equal loads: they alternate, as each counts what we sent it
            request = SubmitRequest(
                req_id=f"r-{i}", gateway_id="", prompt_token_ids=[1], sampling_params=params
            )
            streams[request.req_id] = await client.submit(request)
        held = [[r.req_id for r in shard.submits] for shard in shards]
        assert held == [["r-0", "r-2"], ["r-1", "r-3"]]
        for shard, req_ids in zip(shards, held, strict=True):
            for req_id in req_ids:
                await shard.emit("gw5", req_id, [int(req_id[-1])])
        for req_id, stream in streams.items():
            assert (await asyncio.wait_for(anext(stream), 5)).new_token_ids == [int(req_id[-1])]

        # Shard 1 restarts: only its requests move (to the shard now least loaded: itself).
        shards[1].epoch = "epoch-1b"
        await shards[1].heartbeat()
        await _until(lambda: len(shards[1].submits) == 4)
        moved = shards[1].submits[2:]
        assert sorted(r.req_id for r in moved) == ["r-1.1", "r-3.1"]
        assert sorted(r.output_token_ids for r in moved) == [[1], [3]]
        assert sorted(shards[1].aborts) == ["r-1", "r-3"]
        assert len(shards[0].submits) == 2 and shards[0].aborts == []
        await shards[1].emit("gw5", "r-1", [99])  # late delta of the old id: dropped
        for shard, req_ids in ((shards[0], ["r-0", "r-2"]), (shards[1], ["r-1.1", "r-3.1"])):
            for req_id in req_ids:
                await shard.emit("gw5", req_id, [9], finish="stop")
        for stream in streams.values():
            last = await asyncio.wait_for(anext(stream), 5)
            assert last.new_token_ids == [9] and last.finish_reason == "stop"
        assert client.num_in_flight == 0
    finally:
        await client.close()
        await nc.close()
