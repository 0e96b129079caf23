"""Background tasks of a service: each one named, a crash logged, all cancelled on stop.

Every long-lived loop (heartbeats, probes, a worker's driver, the gateway's in-flight work)
runs through a `BackgroundTasks`, so that no task is lost to garbage collection, no exception
disappears unlogged, and stopping a component cancels everything it started.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

logger = logging.getLogger(__name__)


class BackgroundTasks:
    """The tasks one component started; `cancel()` ends them all."""

    def __init__(self, owner: str) -> None:
        self._owner = owner
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Run `coro` as a task named `<owner>/<name>` until it ends or `cancel()`."""
        task = asyncio.get_running_loop().create_task(coro, name=f"{self._owner}/{name}")
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def cancel(self) -> None:
        """Cancel every task still running (a task may call this on itself)."""
        for task in list(self._tasks):
            task.cancel()
        self._tasks.clear()

    async def stop(self) -> None:
        """Cancel every task and wait until each has ended."""
        tasks = list(self._tasks)
        self.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def __len__(self) -> int:
        return len(self._tasks)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            logger.error("task %s crashed", task.get_name(), exc_info=exc)
