"""Worker messages checked against their subject: a worker publishes on subjects of its own id
(`<prefix>.worker.<id>.<kind>`, which NATS permissions hold it to), so a message whose body
names another worker is a forgery, or a bug, and is dropped."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

from prometheus_client import Counter

from shared.subjects import sender

log = logging.getLogger("skiff.scheduler")

WRONG_SENDER = "wrong_sender"  # the reason label of a dropped message


class FromWorker(Protocol):
    @property
    def worker_id(self) -> str: ...


W = TypeVar("W", bound=FromWorker)


def from_sender(
    handler: Callable[[W], Awaitable[None]], dropped: Counter
) -> Callable[[str, W], Awaitable[None]]:
    """`handler` for the messages whose `worker_id` is their subject's; the others are logged
    and counted in `dropped`."""

    async def checked(subject: str, message: W) -> None:
        worker_id = sender(subject)
        if message.worker_id != worker_id:
            log.warning(
                "dropping a %s naming worker %r on %s: a worker speaks only as itself",
                type(message).__name__,
                message.worker_id,
                subject,
            )
            dropped.labels(WRONG_SENDER).inc()
            return
        await handler(message)

    return checked
