"""Which workers are driven: adopts new and restarted workers, drops silent and leaving ones,
takes a worker that misses a step deadline out of placement until it answers a probe, and
re-places the requests of a worker whose state is gone on the healthy ones, except a request
that was in the steps in flight of `max_request_failures` workers that stalled or were lost
(heartbeats gone, or a new instance after a failed step): it fails instead of taking down
worker after worker."""

from __future__ import annotations

import logging
from collections.abc import Callable

from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.placement import Placement
from services.scheduler.probe import HealthProbe
from services.scheduler.request import Request
from services.scheduler.worker_driver import WorkerDriver
from services.scheduler.worker_pool import WorkerHandle, WorkerPool
from shared.wire import ModelRunnerOutput, WorkerGoodbye, WorkerHello

log = logging.getLogger("skiff.scheduler")


class Liveness:
    """Keeps one running `WorkerDriver` per healthy worker and one `HealthProbe` per unhealthy
    one; `start_driver` and `start_probe` make and start them. `fail_request(request, why)`
    ends a request that reached `max_request_failures` (it is no longer placed)."""

    def __init__(
        self,
        pool: WorkerPool,
        placement: Placement,
        start_driver: Callable[[WorkerHandle], WorkerDriver],
        start_probe: Callable[[WorkerHandle], HealthProbe],
        metrics: SchedulerMetrics,
        *,
        max_request_failures: int,
        fail_request: Callable[[Request, str], None],
    ) -> None:
        self.pool = pool
        self.placement = placement
        self._start_driver = start_driver
        self._start_probe = start_probe
        self._metrics = metrics
        self._max_request_failures = max_request_failures
        self._fail_request = fail_request
        self.drivers: dict[str, WorkerDriver] = {}
        self.probes: dict[str, HealthProbe] = {}

    def adopt(self, hello: WorkerHello, fresh: bool = False, *, stalled: bool = False) -> None:
        """Start driving a new worker, or a fresh core for one whose state is gone (probing it
        first if it is unhealthy); a hello from a known instance only records that it is
        alive (and its progress). A new instance of a driven worker (restarted, or its step
        failed) failed the requests of its steps in flight, as a `stalled` one did."""
        worker, replaced = self.pool.register(hello, fresh)
        wid = hello.worker_id
        if replaced is None and (wid in self.drivers or wid in self.probes):
            return
        survivors: list[Request] = []
        failed: set[str] = set()
        if replaced is not None:
            log.warning("worker %s state reset: its KV cache is gone", wid)
            survivors, in_flight = self._stop(replaced)
            if stalled or replaced.hello.instance_id != hello.instance_id:
                failed = in_flight
        if worker.healthy:
            log.info("worker %s ready: %s, %d blocks", wid, hello.model, hello.num_blocks)
            self._drive(worker)
        else:
            self.probes[wid] = self._start_probe(worker)
        self._migrate(survivors, failed)
        self.placement.place_unplaced()

    def on_stall(self, worker: WorkerHandle) -> None:
        """A step of `worker` missed its deadline: its requests move, with their tokens, to
        the healthy workers, and it gets none until it answers a probe."""
        log.error(
            "worker %s missed a step deadline: unhealthy until it answers a probe; "
            "moving its %d requests",
            worker.worker_id,
            len(worker.core.requests),
        )
        self._metrics.step_timeouts.labels(worker.worker_id).inc()
        self._metrics.worker_healthy.labels(worker.worker_id).set(0)
        worker.healthy = False
        self.adopt(worker.hello, fresh=True, stalled=True)

    def on_healthy(self, worker: WorkerHandle) -> None:
        """`worker` answered its probe: drive it again."""
        probe = self.probes.get(worker.worker_id)
        if probe is None or probe.worker is not worker:
            return
        del self.probes[worker.worker_id]
        log.warning("worker %s answered its probe: healthy again", worker.worker_id)
        worker.healthy = True
        self._drive(worker)
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
            self._drop(worker, lost=True)

    def leave(self, goodbye: WorkerGoodbye) -> None:
        """A worker says goodbye: drop it and re-place its requests at once (a goodbye of
        another instance than the one driven is ignored)."""
        worker = self.pool.workers.get(goodbye.worker_id)
        if worker is None or worker.hello.instance_id != goodbye.instance_id:
            return
        log.info(
            "worker %s is leaving: re-placing its %d requests",
            worker.worker_id,
            len(worker.core.requests),
        )
        self._drop(worker)

    def wake(self, worker_id: str) -> None:
        driver = self.drivers.get(worker_id)
        if driver is not None:
            driver.wake()

    def on_result(self, output: ModelRunnerOutput) -> None:
        driver = self.drivers.get(output.worker_id)
        if driver is not None:
            driver.on_result(output)
        probe = self.probes.get(output.worker_id)
        if probe is not None:
            probe.on_result(output)

    def stop(self) -> None:
        for driver in self.drivers.values():
            driver.stop()
        for probe in self.probes.values():
            probe.stop()
        self.drivers.clear()
        self.probes.clear()

    def _drop(self, worker: WorkerHandle, lost: bool = False) -> None:
        """Forget `worker`; `lost`: it failed the requests of its steps in flight."""
        self.pool.remove(worker.worker_id)
        self._metrics.worker_healthy.remove(worker.worker_id)
        survivors, in_flight = self._stop(worker)
        self._migrate(survivors, in_flight if lost else set())

    def _drive(self, worker: WorkerHandle) -> None:
        self._metrics.worker_healthy.labels(worker.worker_id).set(1)
        self.drivers[worker.worker_id] = self._start_driver(worker)

    def _stop(self, worker: WorkerHandle) -> tuple[list[Request], set[str]]:
        """Stop driving or probing a worker whose state is gone; returns its unfinished
        requests and those of them in its steps in flight."""
        in_flight: set[str] = set()
        driver = self.drivers.pop(worker.worker_id, None)
        if driver is not None:
            in_flight = driver.requests_in_flight()
            driver.stop()
        probe = self.probes.pop(worker.worker_id, None)
        if probe is not None:
            probe.stop()
        return self.placement.evacuate(worker), in_flight

    def _migrate(self, survivors: list[Request], failed: set[str]) -> None:
        """Re-place requests with the tokens generated so far; only their KV cache is lost.
        Those in `failed` count one more failure; one at `max_request_failures` fails."""
        for request in survivors:
            failures = request.num_failures + (request.req_id in failed)
            if failures >= self._max_request_failures:
                self._fail_request(
                    request,
                    f"the request was running on {failures} workers that stalled or failed "
                    "while executing it; it is not retried",
                )
                continue
            moved = request.successor()
            moved.num_failures = failures
            self._metrics.migrations.inc()
            self.placement.place(moved)
