"""The step loop of one worker: plan -> result -> update -> next plan, for as long as its
scheduling core lives. A driver owns the loop's task, the step in flight and the wakeup that
ends its idle waits."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import msgspec

from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.scheduler import RequestOutput
from services.scheduler.worker_pool import WorkerHandle
from shared.protocol import BatchPlan, ModelRunnerOutput

log = logging.getLogger("skiff.scheduler")

Publish = Callable[[str, msgspec.Struct], Awaitable[int]]  # returns the encoded size


class WorkerDriver:
    """Drives one worker's core. `on_outputs` receives each step's outputs; `on_stall` is
    called (from the loop, which then ends) when a step's result is later than
    `step_timeout_s`: the plan or its result was lost and the worker's state is in doubt."""

    def __init__(
        self,
        worker: WorkerHandle,
        *,
        publish: Publish,
        plan_subject: str,
        epoch: str,
        step_timeout_s: float,
        metrics: SchedulerMetrics,
        on_outputs: Callable[[list[RequestOutput]], Awaitable[None]],
        on_stall: Callable[[WorkerHandle], None],
    ) -> None:
        self.worker = worker
        self._publish = publish
        self._plan_subject = plan_subject
        self._session = f"{epoch}:{worker.session}"
        self._step_timeout_s = step_timeout_s
        self._metrics = metrics
        self._on_outputs = on_outputs
        self._on_stall = on_stall
        self._wakeup = asyncio.Event()
        self._pending: tuple[int, asyncio.Future[ModelRunnerOutput]] | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    def stop(self) -> None:
        """Stop driving; a result still on its way is ignored."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        if self._pending is not None:
            self._pending[1].cancel()
            self._pending = None

    def wake(self) -> None:
        """New work (or an abort to pass on) for an idle loop."""
        self._wakeup.set()

    def on_result(self, output: ModelRunnerOutput) -> None:
        """Hand the worker's result to the loop if it answers the step in flight."""
        if self._pending is None or self._pending[0] != output.step_id:
            return
        future = self._pending[1]
        self._pending = None
        if not future.done():
            future.set_result(output)

    async def _run(self) -> None:
        core = self.worker.core
        while True:
            if not core.has_unfinished() and not core.finished_req_ids:
                await self._idle()
            t0 = time.perf_counter()
            plan = core.schedule()
            plan.worker_session = self._session
            if not _has_work(plan):
                await self._idle()
                continue
            now = time.monotonic()
            for new in plan.new_reqs:  # first admission (or arrival on this worker)
                self._metrics.queue_time.observe(now - core.requests[new.req_id].arrival_time)
            future = asyncio.get_running_loop().create_future()
            self._pending = (plan.step_id, future)
            t_sched = time.perf_counter() - t0
            self._metrics.plan_bytes.observe(await self._publish(self._plan_subject, plan))
            t1 = time.perf_counter()
            try:
                output = await asyncio.wait_for(future, self._step_timeout_s)
            except TimeoutError:
                self._stall(plan.step_id)
                return
            wid = self.worker.worker_id
            self._metrics.step_seconds.labels(wid).observe(time.perf_counter() - t1)
            self._metrics.execute_seconds.labels(wid).observe(output.execute_s)
            t2 = time.perf_counter()
            outputs = core.update(output)
            await self._on_outputs(outputs)
            self._metrics.schedule_seconds.observe(t_sched + time.perf_counter() - t2)

    async def _idle(self) -> None:
        self._wakeup.clear()
        await self._wakeup.wait()

    def _stall(self, step_id: int) -> None:
        log.error("worker %s: no result for step %d; resetting it", self.worker.worker_id, step_id)
        self._task = None  # the loop ends here, so stop() must not cancel it
        self._pending = None
        self._on_stall(self.worker)


def _has_work(plan: BatchPlan) -> bool:
    return bool(plan.num_scheduled_tokens or plan.finished_req_ids or plan.preempted_req_ids)
