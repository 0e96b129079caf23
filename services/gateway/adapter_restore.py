"""LoRA adapters loaded at run time live in their scheduler's memory; a scheduler that restarts
(a new epoch: crash, rollout, or a standby taking the Lease) comes back with its
`--lora-modules` only. Every gateway saw the lost ones in the old epoch's heartbeats, and
loads them again on the new scheduler, retrying while it has no worker ready to check them.
Another gateway may be first: an adapter already loaded counts as restored.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from services.gateway.request_stream import EngineError
from shared.wire import LoRAAdapterChange, LoRAAdapterReply

logger = logging.getLogger(__name__)

ChangeLora = Callable[[LoRAAdapterChange], Awaitable[LoRAAdapterReply]]
RESTORE_DEADLINE_S = 120.0  # workers come back within this after their scheduler restarts
FIRST_RETRY_S, LAST_RETRY_S = 0.5, 5.0
UNAVAILABLE = 503


def lost_adapters(before: dict[str, str], after: dict[str, str]) -> dict[str, str]:
    """Adapters (name -> directory) of the old epoch that the new one lacks."""
    return {name: path for name, path in before.items() if name not in after}


async def restore_adapters(
    change_lora: ChangeLora,
    adapters: dict[str, str],
    *,
    shard: str,
    deadline_s: float = RESTORE_DEADLINE_S,
) -> dict[str, str]:
    """Load `adapters` on the restarted scheduler of `shard` (its subject prefix); returns
    those that could not be (refused, or still unavailable at the deadline)."""
    pending, failed = dict(adapters), {}
    delay, deadline = FIRST_RETRY_S, time.monotonic() + deadline_s
    while pending:
        for name, path in list(pending.items()):
            change = LoRAAdapterChange(lora_name=name, lora_path=path, load=True)
            try:
                reply = await change_lora(change)
            except EngineError as e:
                reply = LoRAAdapterReply(ok=False, status=e.status, message=e.message)
            if reply.ok or "already been loaded" in reply.message:
                logger.info("LoRA adapter %s loaded again on restarted %s", name, shard)
                del pending[name]
            elif reply.status != UNAVAILABLE:
                logger.error("LoRA adapter %s not restored on %s: %s", name, shard, reply.message)
                failed[name] = pending.pop(name)
        if pending and time.monotonic() + delay > deadline:
            logger.error("LoRA adapters %s not restored on %s in time", sorted(pending), shard)
            return {**failed, **pending}
        if pending:
            await asyncio.sleep(delay)
            delay = min(2 * delay, LAST_RETRY_S)
    return failed
