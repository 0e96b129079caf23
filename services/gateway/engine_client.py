"""The gateway's only link to the scheduler shards: submit, abort, and per-request token streams.

`EngineClient` is the protocol the HTTP layer uses; `NatsEngineClient` implements it over core
NATS (see `shared.subjects`) by composing `Shards` (each scheduler shard's heartbeat and load),
`NatsTransport` (the connection and every shard's subjects) and `InFlightRequests` (placing
requests on shards, routing deltas, moving requests whose deltas may have been lost).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Sequence
from typing import Protocol

import msgspec

from services.gateway.config import GatewayConfig
from services.gateway.heartbeat import GatewayHeartbeats
from services.gateway.inflight import InFlightRequests
from services.gateway.nats_transport import NatsTransport
from services.gateway.request_stream import EngineError, RequestStream
from services.gateway.shards import Shards
from shared.bus import ConnectOptions
from shared.wire import LoRAAdapterChange, LoRAAdapterReply, SubmitRequest

__all__ = ["EngineClient", "EngineError", "NatsEngineClient", "RequestStream", "new_gateway_id"]


def new_gateway_id() -> str:
    """A random gateway identity (for a gateway not given one)."""
    return f"gw-{uuid.uuid4().hex[:12]}"


class EngineClient(Protocol):
    """What the HTTP layer needs from the engine (a fake one in unit tests)."""

    @property
    def ready(self) -> bool:
        """True when a scheduler with at least one ready worker is reachable."""
        ...

    @property
    def max_model_len(self) -> int | None:
        """The context length the schedulers announced (the smallest), if known."""
        ...

    @property
    def lora_adapters(self) -> dict[str, str]:
        """The LoRA adapters the schedulers serve: name -> directory."""
        ...

    async def submit(self, request: SubmitRequest) -> RequestStream:
        """Submit one request; raises `EngineError` when it is rejected or unanswered."""
        ...

    async def abort(self, req_ids: Sequence[str]) -> None:
        """Abort requests (client gone, stop string hit); unknown ids are ignored."""
        ...

    async def change_lora(self, change: LoRAAdapterChange) -> None:
        """Load or unload a LoRA adapter on every scheduler; raises `EngineError` when one
        refuses (a load is then undone where it succeeded)."""
        ...


class NatsEngineClient:
    """`EngineClient` over NATS to the gateway's scheduler shards; `start()` returns at once and
    connects in the background."""

    def __init__(self, config: GatewayConfig, *, submit_timeout: float = 5.0) -> None:
        """The client `config` describes: its NATS connection, id, shards and timeouts (a
        request waits `scheduler_timeout` for a scheduler: one to take it when new, its
        shard's heartbeat while in flight)."""
        self.gateway_id = config.gateway_id or new_gateway_id()
        self.shards = Shards(
            config.subject_prefix,
            config.scheduler_shards,
            config.heartbeat_timeout,
            config.shard_routing,
            config.shard_routing_max_imbalance,
        )
        self.transport = NatsTransport(
            config.nats_url,
            self.gateway_id,
            self.shards,
            submit_timeout=submit_timeout,
            connect_options=ConnectOptions.from_config(config),
        )
        self.requests = InFlightRequests(
            self.transport,
            orphan_timeout=config.scheduler_timeout,
            resubmit_timeout=config.scheduler_timeout,
        )
        self.stats = self.requests.stats
        self.heartbeats = GatewayHeartbeats(self.transport, self.gateway_id)

    async def start(self) -> None:
        self.transport.start(on_output=self.requests.deliver, on_lost=self.requests.move)
        self.requests.start()
        self.heartbeats.start()

    async def wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self.ready and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.ready

    async def close(self) -> None:
        """Fail what is still in flight, then drain the NATS connection."""
        self.requests.close(EngineError(503, "the gateway is shutting down"))
        self.heartbeats.stop()
        await self.transport.close()

    @property
    def connected(self) -> bool:
        return self.transport.connected

    @property
    def ready(self) -> bool:
        return self.transport.ready

    @property
    def max_model_len(self) -> int | None:
        return self.shards.max_model_len

    @property
    def lora_adapters(self) -> dict[str, str]:
        return self.shards.lora_adapters

    @property
    def num_in_flight(self) -> int:
        return len(self.requests)

    async def submit(self, request: SubmitRequest) -> RequestStream:
        """Waits up to `resubmit_timeout` for a scheduler shard to take the request."""
        request = msgspec.structs.replace(request, gateway_id=self.gateway_id)
        return await self.requests.submit(request)

    async def abort(self, req_ids: Sequence[str]) -> None:
        await self.requests.abort(req_ids)

    async def change_lora(self, change: LoRAAdapterChange) -> None:
        """Every shard heard from lately takes the change, or none does; this gateway knows
        of it at once (the others from the shards' next heartbeats)."""
        shards = [i for i, s in enumerate(self.shards) if self.shards.fresh(s)]
        if not shards:
            raise EngineError(503, "no scheduler is available")
        results = await asyncio.gather(
            *(self.transport.change_lora(i, change) for i in shards), return_exceptions=True
        )
        done = {
            i: r
            for i, r in zip(shards, results, strict=True)
            if isinstance(r, LoRAAdapterReply) and r.ok
        }
        failed = [r for r in results if not (isinstance(r, LoRAAdapterReply) and r.ok)]
        if change.load and failed:
            undo = msgspec.structs.replace(change, load=False)
            await asyncio.gather(
                *(self.transport.change_lora(i, undo) for i in done), return_exceptions=True
            )
        if failed and (change.load or not done):
            error = failed[0]
            if isinstance(error, LoRAAdapterReply):
                raise EngineError(error.status, error.message)
            if isinstance(error, EngineError):
                raise error
            raise EngineError(503, f"the scheduler could not be reached: {error}")
        for i, reply in done.items():
            adapters = dict(self.shards[i].lora_adapters)
            if change.load:
                adapters[change.lora_name] = reply.lora_path
            else:
                adapters.pop(change.lora_name, None)
            self.shards[i].lora_adapters = adapters
