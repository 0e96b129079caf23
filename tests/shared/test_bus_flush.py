"""`bus.flush` against a real nats-server: once it returns, another connection's request finds
the subscription made before it, even when nats-py's flusher task runs late (as on a loaded
machine), where nats-py's own `flush` returns before the SUB was even written."""

from __future__ import annotations

import asyncio

import nats
import nats.errors
import pytest

from shared import bus

LATE = 0.3  # seconds the responder's flusher task holds what it writes


def hold_flusher_writes(nc: nats.NATS) -> None:
    """Make `nc`'s flusher task write its queued commands LATE seconds after it takes them
    (before its drain returns); direct writes such as flush's PING go out at once."""
    transport = nc._transport
    held: list[bytes] = []
    writelines, drain = transport.writelines, transport.drain

    def stash(lines: list[bytes]) -> None:
        held.extend(lines)

    async def late_drain() -> None:
        await asyncio.sleep(LATE)
        writelines(held[:])
        held.clear()
        await drain()

    transport.writelines = stash
    transport.drain = late_drain


@pytest.mark.parametrize("use_bus_flush", [True, False])
def test_a_flushed_subscription_answers_another_connections_request(nats_url, use_bus_flush):
    async def run() -> None:
        responder = await nats.connect(nats_url)
        asker = await nats.connect(nats_url)

        async def answer(msg) -> None:
            await msg.respond(b"pong")

        hold_flusher_writes(responder)
        await responder.subscribe("t.ping", cb=answer)
        if use_bus_flush:
            await bus.flush(responder)
            assert (await asker.request("t.ping", b"", timeout=5)).data == b"pong"
        else:  # the PING overtakes the SUB: the server has no responder yet
            await responder.flush()
            with pytest.raises(nats.errors.NoRespondersError):
                await asker.request("t.ping", b"", timeout=5)
        for nc in (responder, asker):
            await nc.close()

    asyncio.run(run())
