"""The gateway's NATS link to the scheduler, entirely through `shared.bus`.

It follows the scheduler heartbeat (readiness, context length, epoch), receives this gateway's
output batches (reassembled when the scheduler had to split them), sends submits
(request-reply) and aborts. `on_lost` hears of every event after which deltas may have been
lost: a new scheduler epoch, our own reconnection, or NATS dropping messages for a slow consumer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

import msgspec
import nats.errors
from nats.aio.client import Client

from services.gateway.request_stream import EngineError
from shared import bus
from shared.protocol import (
    AbortRequests,
    OutputBatch,
    SchedulerHeartbeat,
    SubmitReply,
    SubmitRequest,
)
from shared.subjects import Subjects

logger = logging.getLogger(__name__)


class NatsTransport:
    """Connection, heartbeat state, and the submit / abort / output subjects of one gateway."""

    def __init__(
        self,
        servers: str | list[str],
        gateway_id: str,
        subjects: Subjects,
        *,
        submit_timeout: float,
        heartbeat_timeout: float,
    ) -> None:
        self.servers = servers
        self.gateway_id = gateway_id
        self.subjects = subjects
        self.submit_timeout = submit_timeout
        self.heartbeat_timeout = heartbeat_timeout
        self.epoch: str | None = None
        self.num_ready_workers = 0
        self.model = ""
        self.max_model_len: int | None = None
        self._last_heartbeat = float("-inf")
        self._nc: Client | None = None
        self._connecting: asyncio.Task[None] | None = None
        self._on_lost: Callable[[str], None] = lambda _reason: None

    def start(
        self,
        on_output: Callable[[OutputBatch], Awaitable[None]],
        on_lost: Callable[[str], None],
    ) -> None:
        """Connect in the background (retrying forever) and subscribe."""
        self._on_lost = on_lost
        self._connecting = asyncio.create_task(self._connect(on_output))

    async def close(self) -> None:
        if self._connecting is not None:
            self._connecting.cancel()
        if self._nc is not None and not self._nc.is_closed:
            with contextlib.suppress(Exception):
                await self._nc.drain()

    @property
    def connected(self) -> bool:
        return self._nc is not None and self._nc.is_connected

    @property
    def heartbeat_age(self) -> float:
        """Seconds since the last scheduler heartbeat (infinite before the first)."""
        return time.monotonic() - self._last_heartbeat

    @property
    def ready(self) -> bool:
        fresh = self.heartbeat_age < self.heartbeat_timeout
        return self.connected and fresh and self.num_ready_workers > 0

    async def submit(self, request: SubmitRequest) -> SubmitReply:
        """Request-reply on the submit subject; raises EngineError(503) when unanswered."""
        if self._nc is None:
            raise EngineError(503, "the gateway is not connected to NATS")
        try:
            return await bus.request(
                self._nc, self.subjects.submit, request, SubmitReply, self.submit_timeout
            )
        except nats.errors.NoRespondersError:
            raise EngineError(503, "no scheduler is listening") from None
        except TimeoutError:
            await self.abort([request.req_id])  # it may have been accepted after all
            raise EngineError(503, "the scheduler did not answer in time") from None
        except (nats.errors.Error, msgspec.DecodeError, OSError) as e:
            raise EngineError(503, f"the scheduler could not be reached: {e}") from None

    async def abort(self, engine_ids: list[str]) -> None:
        if self._nc is None:
            return
        try:
            await bus.publish(self._nc, self.subjects.abort, AbortRequests(req_ids=engine_ids))
        except (nats.errors.Error, OSError) as e:
            logger.warning("abort not sent: %s", e, extra={"req_ids": engine_ids})

    async def _connect(self, on_output: Callable[[OutputBatch], Awaitable[None]]) -> None:
        try:
            self._nc = await bus.connect(
                self.servers,
                f"skiff-gateway-{self.gateway_id}",
                on_reconnect=self._on_reconnect,
                on_error=self._on_error,
            )
            s = self.subjects
            await bus.subscribe(self._nc, s.output(self.gateway_id), OutputBatch, on_output)
            await bus.subscribe(
                self._nc, s.scheduler_heartbeat, SchedulerHeartbeat, self._on_heartbeat
            )
        except Exception:
            logger.exception("cannot connect to NATS at %s", self.servers)
            raise
        logger.info("connected to NATS", extra={"gateway_id": self.gateway_id})

    async def _on_heartbeat(self, beat: SchedulerHeartbeat) -> None:
        self._last_heartbeat = time.monotonic()
        self.num_ready_workers = beat.num_ready_workers
        self.model = beat.model
        self.max_model_len = beat.max_model_len or None
        if beat.epoch != self.epoch:
            if self.epoch is not None:
                self._on_lost(f"scheduler restarted (epoch {self.epoch} -> {beat.epoch})")
            self.epoch = beat.epoch

    async def _on_reconnect(self) -> None:
        self._on_lost("reconnected to NATS")

    async def _on_error(self, e: Exception) -> None:
        if isinstance(e, nats.errors.SlowConsumerError):
            self._on_lost("NATS dropped messages for a slow consumer")
