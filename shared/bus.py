"""NATS connection helpers: reconnect-forever connections and transparent chunking of
messages larger than the server's payload limit (1 MiB by default).

A large payload is published as numbered parts carrying `Skiff-Msg` / `Skiff-Part` headers;
`Reassembler` joins them on the receiving side. Small payloads go out unchanged.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg

log = logging.getLogger("skiff.bus")

HEADER_ROOM = 512  # bytes kept free for subject, headers and protocol framing


async def connect(
    url: str, name: str, on_reconnect: Callable[[], Awaitable[None]] | None = None
) -> Client:
    """Connect and keep reconnecting forever; a NATS blip must never end a service.
    `on_reconnect` runs after each reconnection (messages in flight may have been lost)."""

    async def on_error(exc: Exception) -> None:
        log.warning("nats error: %s", exc)

    async def on_disconnect() -> None:
        log.warning("nats disconnected")

    async def reconnected() -> None:
        log.info("nats reconnected")
        if on_reconnect is not None:
            await on_reconnect()

    return await nats.connect(
        url,
        name=name,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.25,
        connect_timeout=2,
        ping_interval=5,
        max_outstanding_pings=3,
        error_cb=on_error,
        disconnected_cb=on_disconnect,
        reconnected_cb=reconnected,
    )


async def publish(nc: Client, subject: str, payload: bytes, reply: str = "") -> None:
    """Publish, splitting into parts when the payload exceeds the server's limit."""
    limit = max(nc.max_payload - HEADER_ROOM, 1024)
    if len(payload) <= limit:
        await nc.publish(subject, payload, reply=reply)
        return
    msg_id = uuid.uuid4().hex
    parts = [payload[i : i + limit] for i in range(0, len(payload), limit)]
    for i, part in enumerate(parts):
        headers = {"Skiff-Msg": msg_id, "Skiff-Part": f"{i}/{len(parts)}"}
        await nc.publish(subject, part, reply=reply, headers=headers)


class Reassembler:
    """Feeds messages in arrival order; returns whole payloads (NATS keeps per-publisher order
    on one subject, so parts of one message arrive in sequence)."""

    def __init__(self, max_pending: int = 64) -> None:
        self._parts: dict[str, list[bytes]] = {}
        self.max_pending = max_pending

    def feed(self, msg: Msg) -> bytes | None:
        headers = msg.headers or {}
        part = headers.get("Skiff-Part")
        if part is None:
            return msg.data
        msg_id = headers["Skiff-Msg"]
        index, total = (int(x) for x in part.split("/"))
        if index == 0:
            if len(self._parts) >= self.max_pending:  # drop the oldest incomplete message
                self._parts.pop(next(iter(self._parts)))
            self._parts[msg_id] = []
        parts = self._parts.get(msg_id)
        if parts is None or len(parts) != index:
            self._parts.pop(msg_id, None)
            log.warning("dropping out-of-order part %s of %s", part, msg_id)
            return None
        parts.append(msg.data)
        if index + 1 < total:
            return None
        return b"".join(self._parts.pop(msg_id))


async def subscribe(
    nc: Client, subject: str, handler: Callable[[bytes, Msg], Awaitable[None]], queue: str = ""
):
    """Subscribe with reassembly; `handler(payload, last_msg)` sees whole payloads only."""
    reassembler = Reassembler()

    async def on_msg(msg: Msg) -> None:
        payload = reassembler.feed(msg)
        if payload is not None:
            await handler(payload, msg)

    return await nc.subscribe(subject, queue=queue, cb=on_msg)
