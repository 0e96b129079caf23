import asyncio
import logging

import pytest

from shared.arith import cdiv
from shared.tasks import BackgroundTasks

pytestmark = [pytest.mark.unit, pytest.mark.anyio]


def test_cdiv():
    assert [cdiv(n, 16) for n in (0, 1, 15, 16, 17, 32, 33)] == [0, 1, 1, 1, 2, 2, 3]


async def test_spawned_task_is_named_and_cancelled_on_stop():
    tasks = BackgroundTasks("heartbeat")
    started = asyncio.Event()

    async def forever():
        started.set()
        await asyncio.sleep(3600)

    task = tasks.spawn(forever(), "loop")
    await started.wait()
    assert task.get_name() == "heartbeat/loop" and len(tasks) == 1
    await tasks.stop()
    assert task.cancelled() and len(tasks) == 0


async def test_a_crash_is_logged_and_forgotten(caplog):
    tasks = BackgroundTasks("probe")

    async def crash():
        raise RuntimeError("boom")

    with caplog.at_level(logging.ERROR, logger="shared.tasks"):
        task = tasks.spawn(crash(), "run")
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0)
    assert len(tasks) == 0
    assert "task probe/run crashed" in caplog.text and "boom" in caplog.text


async def test_a_task_may_cancel_its_own_group():
    tasks = BackgroundTasks("probe")

    async def finish_then_stop():
        tasks.cancel()

    task = tasks.spawn(finish_then_stop(), "run")
    await asyncio.gather(task, return_exceptions=True)
    assert len(tasks) == 0
