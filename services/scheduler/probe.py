"""Proving a worker healthy again after it missed a step deadline: a plan of its fresh session
that schedules nothing, sent again every `interval_s` until the worker answers one. A hung
worker never answers; one that lost a plan or result answers at once, and one that was only
stalled answers once it catches up with the plans queued for it. The fresh session makes it
drop whatever request state it still holds."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from services.scheduler.worker_driver import Publish
from services.scheduler.worker_pool import WorkerHandle
from shared.wire import BatchPlan, ModelRunnerOutput

log = logging.getLogger("skiff.scheduler")


class HealthProbe:
    """Probes one unhealthy worker; calls `on_healthy(worker)` (from its task, which then
    ends) when the worker answers."""

    def __init__(
        self,
        worker: WorkerHandle,
        *,
        publish: Publish,
        plan_subject: str,
        epoch: str,
        interval_s: float,
        on_healthy: Callable[[WorkerHandle], None],
    ) -> None:
        self.worker = worker
        self._publish = publish
        self._plan_subject = plan_subject
        self._session = worker.plan_session(epoch)
        self._interval_s = interval_s
        self._on_healthy = on_healthy
        # Step ids of a worker only rise (a fresh core continues after the old one's), so a
        # result from this id on answers a probe, and a late one of an old step does not.
        self._first_step_id = worker.core.step_id
        self._answered = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def on_result(self, output: ModelRunnerOutput) -> None:
        if output.step_id >= self._first_step_id:
            self._answered.set()

    async def _run(self) -> None:
        core = self.worker.core
        while not self._answered.is_set():
            plan = BatchPlan(step_id=core.step_id, worker_session=self._session)
            core.step_id += 1
            await self._publish(self._plan_subject, plan)
            try:
                await asyncio.wait_for(self._answered.wait(), self._interval_s)
            except TimeoutError:
                log.debug("worker %s has not answered its probe yet", self.worker.worker_id)
        self._task = None  # ends here, so stop() must not cancel it
        self._on_healthy(self.worker)
