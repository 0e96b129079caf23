"""Messages above NATS's payload limit cross a real nats-server in parts and arrive whole."""

from __future__ import annotations

import asyncio
import os

from shared import bus
from shared.protocol import BatchPlan, NewRequestData, decoder, encode
from shared.sampling_params import SamplingParams


def test_large_message_is_split_and_reassembled(nats_url):
    async def run():
        nc = await bus.connect(nats_url, "test")
        received: list[bytes] = []
        done = asyncio.Event()

        async def handler(payload, _msg):
            received.append(payload)
            if len(received) == 3:
                done.set()

        await bus.subscribe(nc, "t.big", handler)
        # a plan with an 800k-token prompt: several MiB, far above the 1 MiB default limit
        prompt = list(range(100_000, 900_000))
        plan = BatchPlan(
            step_id=1,
            new_reqs=[
                NewRequestData(
                    req_id="r",
                    prompt_token_ids=prompt,
                    sampling_params=SamplingParams(),
                    block_ids=list(range(50_000)),
                    num_computed_tokens=0,
                )
            ],
        )
        big = encode(plan)
        assert len(big) > 2 * nc.max_payload
        small = os.urandom(100)
        await bus.publish(nc, "t.big", big)
        await bus.publish(nc, "t.big", small)
        await bus.publish(nc, "t.big", big)
        await asyncio.wait_for(done.wait(), 10)
        await nc.drain()
        return received, big, small

    received, big, small = asyncio.run(run())
    assert received == [big, small, big]
    assert decoder(BatchPlan).decode(received[0]).new_reqs[0].prompt_token_ids[-1] == 899_999
