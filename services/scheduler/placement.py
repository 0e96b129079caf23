"""Which worker holds each request, and the requests waiting for any worker to come (back)."""

from __future__ import annotations

import functools
from collections.abc import Callable

from services.scheduler.handoff import Handoff
from services.scheduler.request import Request
from services.scheduler.worker_pool import WorkerHandle, WorkerPool


class Placement:
    """Puts requests on the cheapest worker of `pool` and keeps track of them until they
    finish, are aborted or lose their worker. `wake(worker_id)` tells that worker's driver
    there is something to schedule; `on_landed` (`Handoff.on_landed`) hears of each hand-over
    from a prefill worker that landed."""

    def __init__(
        self,
        pool: WorkerPool,
        wake: Callable[[str], None],
        on_landed: Callable[[Handoff, int], None] = lambda _handoff, _bytes: None,
    ) -> None:
        self.pool = pool
        self._wake = wake
        self._on_landed = on_landed
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

    def hand_off(self, source: WorkerHandle, request: Request) -> None:
        """Move a request that the prefill worker `source` computed up to its first token
        (`Scheduler.hand_off_ready`) to a decode worker, which fetches its blocks from
        `source`; with no decode worker to take it, it decodes on `source`, where its blocks
        are (released at once, to be found in its prefix cache)."""
        moved = request.successor()
        moved.num_cached_tokens = request.num_cached_tokens
        release = functools.partial(source.core.release_handed_off, request.req_id)
        moved.handoff = Handoff(source.worker_id, release, self._on_landed)
        target = self.pool.select_decode(moved, source)
        if target is None:
            moved.handoff.local = True
            release()
            target = source
        target.core.add_request(moved)
        self.worker_of[moved.req_id] = target
        self._wake(target.worker_id)

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
            if request.handoff is not None:
                request.handoff.drop()
        return survivors
