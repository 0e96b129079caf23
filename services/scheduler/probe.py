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
from shared.tasks import BackgroundTasks
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
        self._epoch = epoch
        self._interval_s = interval_s
        self._on_healthy = on_healthy
        # Step ids of a worker only rise (a fresh core continues after the old one's), so a
        # result from this id on answers a probe, and a late one of an old step does not.
        self._first_step_id = worker.core.step_id
        self._answered = asyncio.Event()
        self._tasks = BackgroundTasks("probe")

    def start(self) -> None:
        self._tasks.spawn(self._run(), self.worker.worker_id)

    def stop(self) -> None:
        self._tasks.cancel()

    def on_result(self, output: ModelRunnerOutput) -> None:
        if output.step_id >= self._first_step_id:
            self._answered.set()

    async def _run(self) -> None:
        core = self.worker.core
        while not self._answered.is_set():
            plan = BatchPlan(
                step_id=core.step_id,
                scheduler_epoch=self._epoch,
                worker_session=self.worker.session,
            )
            core.step_id += 1
            await self._publish(self._plan_subject, plan)
            try:
                await asyncio.wait_for(self._answered.wait(), self._interval_s)
            except TimeoutError:
                log.debug("worker %s has not answered its probe yet", self.worker.worker_id)
        self._on_healthy(self.worker)
