"""shared.bus against a real nats-server: split messages arrive whole, malformed and
wrong-version messages are refused, request-reply round-trips."""

from __future__ import annotations

import asyncio

import msgspec
import nats.errors
import pytest

from shared import bus
from shared.sampling_params import SamplingParams
from shared.wire import (
    AbortRequests,
    BatchPlan,
    NewRequestData,
    SubmitReply,
    SubmitRequest,
    encode,
)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class _Collector:
    """A subscribe handler that records messages and lets a test wait for a count."""

    def __init__(self) -> None:
        self.messages: list[msgspec.Struct] = []
        self._changed = asyncio.Event()

    async def __call__(self, message: msgspec.Struct) -> None:
        self.messages.append(message)
        self._changed.set()

    async def wait_for(self, count: int) -> None:
        async with asyncio.timeout(10):
            while len(self.messages) < count:
                self._changed.clear()
                await self._changed.wait()


def _big_plan(step_id: int) -> BatchPlan:
    """A plan with an 800k-token prompt: several MiB, far above the 1 MiB default limit."""
    new = NewRequestData(
        req_id="r",
        prompt_token_ids=list(range(100_000, 900_000)),
        sampling_params=SamplingParams(),
        block_ids=list(range(50_000)),
        num_computed_tokens=0,
    )
    return BatchPlan(step_id=step_id, new_reqs=[new])


@pytest.mark.anyio
async def test_large_message_is_split_and_reassembled(nats_url):
    nc = await bus.connect(nats_url, "test")
    try:
        got = _Collector()
        await bus.subscribe(nc, "t.big", BatchPlan, got)
        big = _big_plan(1)
        assert len(encode(big)) > 2 * nc.max_payload
        await bus.publish(nc, "t.big", big)
        await bus.publish(nc, "t.big", BatchPlan(step_id=2))
        await bus.publish(nc, "t.big", _big_plan(3))
        await got.wait_for(3)
        assert got.messages == [big, BatchPlan(step_id=2), _big_plan(3)]
    finally:
        await nc.drain()


@pytest.mark.anyio
async def test_malformed_and_wrong_version_messages_are_dropped(nats_url):
    nc = await bus.connect(nats_url, "test")
    try:
        got = _Collector()
        await bus.subscribe(nc, "t.abort", AbortRequests, got)
        await nc.publish("t.abort", b"\xc1 not msgpack")
        await nc.publish("t.abort", encode(BatchPlan(step_id=1)))  # another message type
        await bus.publish(nc, "t.abort", AbortRequests(req_ids=["old"], version=0))
        bad_part = {"Skiff-Msg": "m", "Skiff-Part": "x/2"}
        await nc.publish("t.abort", b"\x00", headers=bad_part)
        await nc.publish("t.abort", b"\x00", headers={"Skiff-Part": "0/2"})  # no message id
        await nc.publish("t.abort", b"\x00", headers={"Skiff-Msg": "m", "Skiff-Part": "1/2"})
        await bus.publish(nc, "t.abort", AbortRequests(req_ids=["ok"]))
        await got.wait_for(1)
        await nc.flush()
        await asyncio.sleep(0.1)
        assert got.messages == [AbortRequests(req_ids=["ok"])]
    finally:
        await nc.drain()


def test_reassembler_drops_incomplete_messages():
    from nats.aio.msg import Msg

    def part(msg_id: str, index: int, total: int, data: bytes) -> Msg:
        headers = {"Skiff-Msg": msg_id, "Skiff-Part": f"{index}/{total}"}
        return Msg(None, subject="s", data=data, headers=headers)  # type: ignore[arg-type]

    r = bus.Reassembler(max_pending=2)
    assert r.feed(part("a", 0, 2, b"a0")) is None
    assert r.feed(part("b", 0, 2, b"b0")) is None
    assert r.feed(part("c", 0, 2, b"c0")) is None  # evicts "a", the oldest
    assert r.feed(part("a", 1, 2, b"a1")) is None
    assert r.feed(part("c", 1, 2, b"c1")) == b"c0c1"
    assert r.feed(part("b", 2, 2, b"b2")) is None  # out of order: "b" is dropped
    assert r.feed(part("b", 1, 2, b"b1")) is None
    assert r.feed(Msg(None, subject="s", data=b"whole")) == b"whole"  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_request_serve_round_trip(nats_url):
    nc = await bus.connect(nats_url, "test")
    try:

        async def admit(sub: SubmitRequest) -> SubmitReply:
            return SubmitReply(accepted=True, message=sub.req_id)

        def malformed(error: str) -> SubmitReply:
            return SubmitReply(accepted=False, status=400, message=error)

        await bus.serve(nc, "t.submit", SubmitRequest, admit, on_malformed=malformed)
        request = SubmitRequest(
            req_id="r1", gateway_id="g", prompt_token_ids=[1, 2], sampling_params=SamplingParams()
        )
        reply = await bus.request(nc, "t.submit", request, SubmitReply, timeout=5)
        assert reply == SubmitReply(accepted=True, message="r1")

        old = msgspec.structs.replace(request, version=0)
        reply = await bus.request(nc, "t.submit", old, SubmitReply, timeout=5)
        assert (reply.accepted, reply.status) == (False, 400)
        assert "protocol version 0" in reply.message
        reply = await bus.request(nc, "t.submit", BatchPlan(step_id=1), SubmitReply, timeout=5)
        assert (reply.accepted, reply.status) == (False, 400)

        with pytest.raises(nats.errors.NoRespondersError):
            await bus.request(nc, "t.nobody", request, SubmitReply, timeout=5)
    finally:
        await nc.drain()


@pytest.mark.anyio
async def test_request_refuses_bad_replies_and_serve_drops_bad_requests(nats_url):
    nc = await bus.connect(nats_url, "test")
    try:

        async def old_peer(_sub: SubmitRequest) -> SubmitReply:
            return SubmitReply(accepted=True, version=0)

        async def garbage(msg) -> None:
            await msg.respond(b"\xc1")

        await bus.serve(nc, "t.old", SubmitRequest, old_peer)
        await nc.subscribe("t.garbage", cb=garbage)
        request = SubmitRequest(
            req_id="r", gateway_id="g", prompt_token_ids=[1], sampling_params=SamplingParams()
        )
        with pytest.raises(bus.IncompatibleVersionError):
            await bus.request(nc, "t.old", request, SubmitReply, timeout=5)
        with pytest.raises(msgspec.DecodeError):
            await bus.request(nc, "t.garbage", request, SubmitReply, timeout=5)
        with pytest.raises(nats.errors.TimeoutError):  # no on_malformed: no reply at all
            await bus.request(nc, "t.old", AbortRequests(req_ids=[]), SubmitReply, timeout=0.3)
    finally:
        await nc.drain()
