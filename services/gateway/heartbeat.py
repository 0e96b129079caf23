"""The gateway's heartbeat: a `GatewayHeartbeat` to every scheduler shard each second while
connected. A scheduler that stops hearing it aborts this gateway's requests, whose clients died
with it."""

from __future__ import annotations

import asyncio
import logging

import nats.errors

from services.gateway.nats_transport import NatsTransport
from shared.tasks import BackgroundTasks
from shared.wire import GatewayHeartbeat

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 1.0  # schedulers give up on a gateway after --gateway-timeout (15 s)


class GatewayHeartbeats:
    def __init__(
        self, transport: NatsTransport, gateway_id: str, interval_s: float = HEARTBEAT_INTERVAL_S
    ) -> None:
        self._transport = transport
        self._beat = GatewayHeartbeat(gateway_id=gateway_id)
        self._interval_s = interval_s
        self._tasks = BackgroundTasks("gateway-heartbeat")

    def start(self) -> None:
        self._tasks.spawn(self._run(), "beat")

    def stop(self) -> None:
        self._tasks.cancel()

    async def _run(self) -> None:
        while True:
            try:
                await self._transport.publish_to_shards(lambda s: s.gateway_heartbeat, self._beat)
            except (nats.errors.Error, OSError) as e:
                logger.warning("gateway heartbeat not sent: %s", e)
            await asyncio.sleep(self._interval_s)
