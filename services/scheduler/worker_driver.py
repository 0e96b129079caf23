"""The step loop of one worker: plan -> result -> update -> next plan, for as long as its
scheduling core lives. With async scheduling the loop keeps two plans in flight, so the worker
finds step N+1 queued when step N ends and never waits for the scheduler between steps. A driver
owns the loop's task, the steps in flight and the wakeup that ends its idle waits."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgspec

from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.request import Request
from services.scheduler.scheduler import RequestOutput, plan_has_work
from services.scheduler.tracing import RequestTraces
from services.scheduler.worker_pool import WorkerHandle
from shared.tasks import BackgroundTasks
from shared.wire import BatchPlan, ModelRunnerOutput

log = logging.getLogger("skiff.scheduler")

Publish = Callable[[str, msgspec.Struct], Awaitable[int]]  # returns the encoded size


@dataclass(frozen=True)
class StepDeadline:
    """How long a step may go without its result or progress reported on it: `base_s` plus
    `per_token_s` per scheduled token."""

    base_s: float
    per_token_s: float = 0.0

    def seconds(self, num_tokens: int) -> float:
        return self.base_s + self.per_token_s * num_tokens


@dataclass
class StepInFlight:
    step_id: int
    num_tokens: int  # scheduled in this step
    published_at: float  # perf_counter() after the plan was handed to NATS
    result: asyncio.Future[ModelRunnerOutput]
    req_ids: tuple[str, ...] = ()  # the requests it schedules tokens of


class WorkerDriver:
    """Drives one worker's core. `on_outputs` receives each step's outputs; `on_handoff`
    each request the core hands to a decode worker (`Scheduler.hand_off_ready`); `on_stall` is
    called (from the loop, which then ends) when a step's result misses its `deadline`,
    counted from when the worker could start it (its publication, or the previous result with
    two plans in flight) or from the last heartbeat that reported progress on the step,
    whichever is later: the worker hangs, or the plan or its result was lost. A long step
    (attention over a long context costs more than any allowance per token) thus runs as long
    as its worker reports progress on it at least once per deadline, and a worker that stops
    progressing is caught one deadline after its last progress."""

    def __init__(
        self,
        worker: WorkerHandle,
        *,
        publish: Publish,
        plan_subject: str,
        epoch: str,
        deadline: StepDeadline,
        metrics: SchedulerMetrics,
        on_outputs: Callable[[list[RequestOutput]], Awaitable[None]],
        on_handoff: Callable[[WorkerHandle, Request], None],
        on_stall: Callable[[WorkerHandle], None],
        traces: RequestTraces | None = None,
    ) -> None:
        self.worker = worker
        self._publish = publish
        self._plan_subject = plan_subject
        self._epoch = epoch
        self._deadline = deadline
        self._metrics = metrics
        self._on_outputs = on_outputs
        self._on_handoff = on_handoff
        self._on_stall = on_stall
        self._traces = traces  # None: tracing off
        self._max_in_flight = worker.core.max_plans_in_flight
        self._wakeup = asyncio.Event()
        self._in_flight: deque[StepInFlight] = deque()  # oldest first
        self._tasks = BackgroundTasks("driver")
        self._result_at = 0.0  # perf_counter() when the last result came in
        wid = worker.worker_id
        self._plans_in_flight = metrics.plans_in_flight.labels(wid)
        # Each worker's series exist (at 0) from its first plan, not its first result: rate()
        # then sees the increase of a step that ends between two scrapes.
        self._step_seconds = metrics.step_seconds.labels(wid)
        self._nats_round_trip = metrics.nats_round_trip.labels(wid)
        self._execute_seconds = metrics.execute_seconds.labels(wid)
        self._idle_seconds = metrics.worker_idle_seconds.labels(wid)

    def start(self) -> None:
        self._tasks.spawn(self._run(), self.worker.worker_id)

    def stop(self) -> None:
        """Stop driving (also from `on_stall`, which ends the loop); results still on their
        way are ignored."""
        self._tasks.cancel()
        for step in self._in_flight:
            step.result.cancel()
        self._in_flight.clear()
        self._plans_in_flight.set(0)

    def wake(self) -> None:
        """New work (or an abort to pass on) for an idle loop."""
        self._wakeup.set()

    def requests_in_flight(self) -> set[str]:
        """The requests scheduled in the steps published and not answered yet."""
        return {req_id for step in self._in_flight for req_id in step.req_ids}

    def on_result(self, output: ModelRunnerOutput) -> None:
        """Hand the worker's result to the loop if it answers a step in flight."""
        for step in self._in_flight:
            if step.step_id == output.step_id and not step.result.done():
                step.result.set_result(output)
                return

    async def _run(self) -> None:
        core = self.worker.core
        await self._announce()
        while True:
            schedule_s = await self._fill()
            if not self._in_flight:
                await self._idle()
                continue
            step = self._in_flight[0]
            try:
                output = await self._result(step)
            except TimeoutError:
                self._stall(step.step_id)
                return
            self._in_flight.popleft()
            self._plans_in_flight.set(len(self._in_flight))
            received_at = time.perf_counter()
            self._step_seconds.observe(received_at - step.published_at)
            could_start = max(step.published_at, self._result_at)
            self._result_at = received_at
            transit = received_at - could_start - output.execute_s - output.idle_s
            self._nats_round_trip.observe(max(transit, 0.0))
            self._execute_seconds.observe(output.execute_s)
            self._idle_seconds.inc(output.idle_s)
            t0 = time.perf_counter()
            outputs = core.update(output)
            for request in core.hand_off_ready():
                self._on_handoff(self.worker, request)
            await self._on_outputs(outputs)
            self._metrics.schedule_seconds.observe(schedule_s + time.perf_counter() - t0)

    async def _result(self, step: StepInFlight) -> ModelRunnerOutput:
        """`step`'s result; raises TimeoutError once neither it nor progress on it came for
        the step's deadline. Progress comes with heartbeats (`WorkerHandle.heard`), so the
        wait is cut at the deadline from the latest report, never polled."""
        timeout = self._deadline.seconds(step.num_tokens)
        since = time.monotonic()  # when the worker could start it
        while True:
            worker = self.worker
            if worker.progress_step_id == step.step_id:
                since = max(since, worker.progress_at)
            left = since + timeout - time.monotonic()
            if left <= 0:
                raise TimeoutError
            try:
                return await asyncio.wait_for(asyncio.shield(step.result), left)
            except TimeoutError:
                continue

    async def _announce(self) -> None:
        """First an empty plan of the new session: the worker drops what it held and knows it
        is adopted (its readiness) even while no request comes. Its result is ignored."""
        plan = BatchPlan(step_id=self.worker.core.step_id)
        self._stamp(plan)
        self.worker.core.step_id += 1
        await self._publish(self._plan_subject, plan)

    async def _fill(self) -> float:
        """Plan and publish until the steps in flight are at their limit or there is nothing
        to do; returns the time spent in `schedule()`."""
        core, loop, spent = self.worker.core, asyncio.get_running_loop(), 0.0
        while len(self._in_flight) < self._max_in_flight:
            t0 = time.perf_counter()
            plan = core.schedule()
            spent += time.perf_counter() - t0
            if not plan_has_work(plan):
                break
            self._stamp(plan)
            now = time.monotonic()
            for new in plan.new_reqs:  # first admission (or arrival on this worker)
                request = core.requests[new.req_id]
                if not request.num_output_tokens:  # a moved one was admitted before
                    self._metrics.queue_time.observe(now - request.arrival_time)
            step = StepInFlight(
                plan.step_id,
                plan.total_num_scheduled_tokens,
                time.perf_counter(),
                loop.create_future(),
                tuple(plan.num_scheduled_tokens),
            )
            self._in_flight.append(step)  # before the await: the result may beat it back
            if self._traces is not None:
                self._traces.planned(plan, self.worker.worker_id)
            self._plans_in_flight.set(len(self._in_flight))
            self._metrics.plan_bytes.observe(await self._publish(self._plan_subject, plan))
            step.published_at = time.perf_counter()
        return spent

    def _stamp(self, plan: BatchPlan) -> None:
        """Mark `plan` as one of this scheduler's epoch and this core's session."""
        plan.scheduler_epoch, plan.worker_session = self._epoch, self.worker.session

    async def _idle(self) -> None:
        self._wakeup.clear()
        await self._wakeup.wait()

    def _stall(self, step_id: int) -> None:
        """`on_stall` still finds the steps in flight (`requests_in_flight`)."""
        log.error(
            "worker %s: no result or progress for step %d in time", self.worker.worker_id, step_id
        )
        self._on_stall(self.worker)
        self._in_flight.clear()
        self._plans_in_flight.set(0)
