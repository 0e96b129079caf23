"""Asking a running stack's scheduler (or one shard's) for its `SchedulerStats`."""

from __future__ import annotations

import asyncio

import msgspec

from shared import bus
from shared.config import DEFAULT_SUBJECT_PREFIX
from shared.subjects import Subjects
from shared.wire import SchedulerStats, SchedulerStatsRequest


def scheduler_stats(stack, prefix: str = DEFAULT_SUBJECT_PREFIX) -> dict:
    async def ask():
        nc = await bus.connect(stack.nats_url, "test-stats", **stack.nats_options())
        try:
            stats = await bus.request(
                nc, Subjects(prefix).scheduler_stats, SchedulerStatsRequest(), SchedulerStats, 5
            )
            return msgspec.to_builtins(stats)
        finally:
            await nc.drain()

    return asyncio.run(ask())
