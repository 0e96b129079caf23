"""The gateway's NATS link to the scheduler shards, entirely through `shared.bus`.

One connection for every shard. Per shard it follows the scheduler heartbeat (into `Shards`),
receives this gateway's output batches (reassembled when the scheduler had to split them), and
sends submits (request-reply) and aborts. `on_lost(reason, shard)` hears of every event after
which deltas may have been lost or will stop: a new epoch of one shard's scheduler, or its
scheduler announcing that it leaves (`shard` is its index), our own reconnection or NATS
dropping messages for a slow consumer (`shard` is None: every shard's). A restarted scheduler
gets the LoRA adapters loaded at run time again (`adapter_restore`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable

import msgspec
import nats.errors
from nats.aio.client import Client

from services.gateway.adapter_restore import lost_adapters, restore_adapters
from services.gateway.request_stream import EngineError
from services.gateway.shards import Shards
from shared import bus
from shared.epochs import supersedes
from shared.subjects import Subjects
from shared.tasks import BackgroundTasks
from shared.wire import (
    AbortRequests,
    LoRAAdapterChange,
    LoRAAdapterReply,
    OutputBatch,
    SchedulerHeartbeat,
    SubmitReply,
    SubmitRequest,
)

logger = logging.getLogger(__name__)

LostCallback = Callable[[str, int | None], None]
# A load waits for a worker to read the adapter (the scheduler gives it 30 s)
LORA_CHANGE_TIMEOUT_S = 40.0


class NatsTransport:
    """Connection, shard heartbeats, and the submit / abort / output subjects of one gateway."""

    def __init__(
        self,
        servers: str | list[str],
        gateway_id: str,
        shards: Shards,
        *,
        submit_timeout: float,
        connect_options: bus.ConnectOptions | None = None,
    ) -> None:
        self.servers = servers
        self.connect_options = connect_options
        self.gateway_id = gateway_id
        self.shards = shards
        self.submit_timeout = submit_timeout
        self._nc: Client | None = None
        self._tasks = BackgroundTasks("gateway-nats")  # connecting
        self._on_lost: LostCallback = lambda _reason, _shard: None

    def start(
        self, on_output: Callable[[OutputBatch], Awaitable[None]], on_lost: LostCallback
    ) -> None:
        """Connect in the background (retrying forever) and subscribe."""
        self._on_lost = on_lost
        self._tasks.spawn(self._connect(on_output), "connect")

    async def close(self) -> None:
        self._tasks.cancel()
        if self._nc is not None and not self._nc.is_closed:
            with contextlib.suppress(Exception):
                await self._nc.drain()

    @property
    def connected(self) -> bool:
        return self._nc is not None and self._nc.is_connected

    @property
    def ready(self) -> bool:
        return self.connected and self.shards.ready

    async def submit(self, shard: int, request: SubmitRequest) -> SubmitReply:
        """Request-reply on a shard's submit subject; raises EngineError(503) when unanswered."""
        if self._nc is None:
            raise EngineError(503, "the gateway is not connected to NATS")
        subject = self.shards[shard].subjects.submit
        try:
            return await bus.request(self._nc, subject, request, SubmitReply, self.submit_timeout)
        except nats.errors.NoRespondersError:
            raise EngineError(503, "no scheduler is listening") from None
        except TimeoutError:
            await self.abort(shard, [request.req_id])  # it may have been accepted after all
            raise EngineError(503, "the scheduler did not answer in time") from None
        except (nats.errors.Error, msgspec.DecodeError, OSError) as e:
            raise EngineError(503, f"the scheduler could not be reached: {e}") from None

    async def change_lora(self, shard: int, change: LoRAAdapterChange) -> LoRAAdapterReply:
        """Request-reply on a shard's adapter subject; raises EngineError(503) when
        unanswered."""
        if self._nc is None:
            raise EngineError(503, "the gateway is not connected to NATS")
        subject = self.shards[shard].subjects.lora_adapters
        try:
            return await bus.request(
                self._nc, subject, change, LoRAAdapterReply, LORA_CHANGE_TIMEOUT_S
            )
        except nats.errors.NoRespondersError:
            raise EngineError(503, "no scheduler is listening") from None
        except TimeoutError:
            raise EngineError(503, "the scheduler did not answer in time") from None
        except (nats.errors.Error, msgspec.DecodeError, OSError) as e:
            raise EngineError(503, f"the scheduler could not be reached: {e}") from None

    async def publish_to_shards(
        self, subject: Callable[[Subjects], str], msg: msgspec.Struct
    ) -> None:
        """Publish `msg` on `subject(shard subjects)` of every shard; nothing while
        disconnected."""
        if self._nc is None or not self._nc.is_connected:
            return
        for shard in self.shards:
            await bus.publish(self._nc, subject(shard.subjects), msg)

    async def abort(self, shard: int, engine_ids: list[str]) -> None:
        if self._nc is None:
            return
        subject = self.shards[shard].subjects.abort
        try:
            await bus.publish(self._nc, subject, AbortRequests(req_ids=engine_ids))
        except (nats.errors.Error, OSError) as e:
            logger.warning("abort not sent: %s", e, extra={"req_ids": engine_ids})

    async def _connect(self, on_output: Callable[[OutputBatch], Awaitable[None]]) -> None:
        try:
            nc = await bus.connect(
                self.servers,
                f"skiff-gateway-{self.gateway_id}",
                options=self.connect_options,
                on_reconnect=self._on_reconnect,
                on_error=self._on_error,
            )
            for index, shard in enumerate(self.shards):
                s = shard.subjects
                await bus.subscribe(nc, s.output(self.gateway_id), OutputBatch, on_output)
                on_heartbeat = functools.partial(self._on_heartbeat, index)
                await bus.subscribe(nc, s.scheduler_heartbeat, SchedulerHeartbeat, on_heartbeat)
            await nc.flush()  # the server has the subscriptions: nothing sent from now is missed
            self._nc = nc  # connected from here on
        except Exception:
            logger.exception("cannot connect to NATS at %s", self.servers)
            return  # logged once here, with the servers (not again as a task crash)
        logger.info("connected to NATS", extra={"gateway_id": self.gateway_id})

    async def _on_heartbeat(self, index: int, beat: SchedulerHeartbeat) -> None:
        shard = self.shards[index]
        previous, was_leaving, adapters = shard.epoch, shard.leaving, shard.lora_adapters
        if not supersedes(beat.epoch, previous, current_silent=not self.shards.fresh(shard)):
            logger.debug("ignoring a heartbeat of stale epoch %s", beat.epoch)
            return
        if self.shards.heartbeat(index, beat):
            reason = f"scheduler on {shard.subjects.prefix} restarted"
            self._on_lost(f"{reason} (epoch {previous} -> {beat.epoch})", index)
            if lost := lost_adapters(adapters, beat.lora_adapters):
                restore = restore_adapters(
                    functools.partial(self.change_lora, index), lost, shard=shard.subjects.prefix
                )
                self._tasks.spawn(restore, f"restore-adapters-{index}")
        elif beat.leaving and not was_leaving:
            self._on_lost(f"scheduler on {shard.subjects.prefix} is leaving", index)

    async def _on_reconnect(self) -> None:
        self._on_lost("reconnected to NATS", None)

    async def _on_error(self, e: Exception) -> None:
        if isinstance(e, nats.errors.SlowConsumerError):
            self._on_lost("NATS dropped messages for a slow consumer", None)
