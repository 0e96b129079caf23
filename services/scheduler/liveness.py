"""Which workers are driven: adopts new and restarted workers, drops silent ones, and
re-places the requests of a worker whose state is gone on the live ones."""

from __future__ import annotations

import logging
from collections.abc import Callable

from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.placement import Placement
from services.scheduler.request import Request
from services.scheduler.worker_driver import WorkerDriver
from services.scheduler.worker_pool import WorkerHandle, WorkerPool
from shared.protocol import ModelRunnerOutput, WorkerHello

log = logging.getLogger("skiff.scheduler")


class Liveness:
    """Keeps one running `WorkerDriver` per live worker; `start_driver` makes and starts one."""

    def __init__(
        self,
        pool: WorkerPool,
        placement: Placement,
        start_driver: Callable[[WorkerHandle], WorkerDriver],
        metrics: SchedulerMetrics,
    ) -> None:
        self.pool = pool
        self.placement = placement
        self._start_driver = start_driver
        self._metrics = metrics
        self.drivers: dict[str, WorkerDriver] = {}

    def adopt(self, hello: WorkerHello, fresh: bool = False) -> None:
        """Start driving a new worker, or a fresh core for one whose state is gone; a hello
        from a known instance only records that it is alive."""
        worker, replaced = self.pool.register(hello, fresh)
        survivors: list[Request] = []
        if replaced is not None:
            log.warning("worker %s state reset: its KV cache is gone", hello.worker_id)
            survivors = self._stop(replaced)
        if hello.worker_id not in self.drivers:
            log.info(
                "worker %s ready: %s, %d blocks", hello.worker_id, hello.model, hello.num_blocks
            )
            self.drivers[hello.worker_id] = self._start_driver(worker)
            self._migrate(survivors)
            self.placement.place_unplaced()

    def reset_all(self) -> None:
        """Restart every worker on a fresh core (a new session makes the worker drop its
        state) and recompute the work in flight: after a NATS blip a plan or result may be
        lost."""
        for worker in list(self.pool.workers.values()):
            self.adopt(worker.hello, fresh=True)

    def expire(self, timeout_s: float) -> None:
        """Drop the workers silent for longer than `timeout_s` and re-place their requests."""
        for worker in self.pool.expired(timeout_s):
            log.warning(
                "worker %s missed its heartbeats: re-placing its requests", worker.worker_id
            )
            self.pool.remove(worker.worker_id)
            self._migrate(self._stop(worker))

    def wake(self, worker_id: str) -> None:
        driver = self.drivers.get(worker_id)
        if driver is not None:
            driver.wake()

    def on_result(self, output: ModelRunnerOutput) -> None:
        driver = self.drivers.get(output.worker_id)
        if driver is not None:
            driver.on_result(output)

    def stop(self) -> None:
        for driver in self.drivers.values():
            driver.stop()
        self.drivers.clear()

    def _stop(self, worker: WorkerHandle) -> list[Request]:
        """Stop driving a worker whose state is gone; returns its unfinished requests."""
        driver = self.drivers.pop(worker.worker_id, None)
        if driver is not None:
            driver.stop()
        return self.placement.evacuate(worker)

    def _migrate(self, survivors: list[Request]) -> None:
        """Re-place requests with the tokens generated so far; only their KV cache is lost."""
        for request in survivors:
            moved = Request(
                request.req_id,
                request.prompt_token_ids,
                request.sampling_params,
                output_token_ids=request.output_token_ids,
                priority=request.priority,
            )
            moved.arrival_time = request.arrival_time
            self._metrics.migrations.inc()
            self.placement.place(moved)
