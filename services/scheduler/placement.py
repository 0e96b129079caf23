"""Which worker holds each request, and the requests waiting for any worker to come (back)."""

from __future__ import annotations

from collections.abc import Callable

from services.scheduler.request import Request
from services.scheduler.worker_pool import WorkerHandle, WorkerPool


class Placement:
    """Puts requests on the cheapest worker of `pool` and keeps track of them until they
    finish, are aborted or lose their worker. `wake(worker_id)` tells that worker's driver
    there is something to schedule."""

    def __init__(self, pool: WorkerPool, wake: Callable[[str], None]) -> None:
        self.pool = pool
        self._wake = wake
        self.worker_of: dict[str, WorkerHandle] = {}  # req_id -> worker
        self.unplaced: list[Request] = []

    def __contains__(self, req_id: str) -> bool:
        """Whether a request with this id is placed on a worker."""
        return req_id in self.worker_of

    @property
    def num_requests(self) -> int:
        return len(self.worker_of) + len(self.unplaced)

    def place(self, request: Request) -> None:
        try:
            worker = self.pool.select(request)
        except LookupError:
            self.unplaced.append(request)
            return
        worker.core.add_request(request)
        self.worker_of[request.req_id] = worker
        self._wake(worker.worker_id)

    def place_unplaced(self) -> None:
        pending, self.unplaced = self.unplaced, []
        for request in pending:
            self.place(request)

    def abort(self, req_id: str) -> None:
        worker = self.worker_of.pop(req_id, None)
        self.unplaced = [r for r in self.unplaced if r.req_id != req_id]
        if worker is not None:
            worker.core.abort([req_id])
            self._wake(worker.worker_id)  # tell the worker to free its state

    def finish(self, req_id: str) -> None:
        self.worker_of.pop(req_id, None)

    def evacuate(self, worker: WorkerHandle) -> list[Request]:
        """Forget the placements on a worker whose state is gone; returns its unfinished
        requests (the pins its prefix loads hold on other workers are released)."""
        survivors = worker.core.unfinished_requests()
        worker.core.loads.cancel_all()
        for request in survivors:
            self.worker_of.pop(request.req_id, None)
        return survivors
