"""The scheduler's spans of traced requests (those that came with a `traceparent`), all
children of the gateway's `generate` span:

* `queue`: from admission until a worker first runs it (its first plan there);
* `place`: choosing its worker (`skiff.worker_id`, empty while no worker can take it);
* `run`: its time on one worker, from its first plan there until it finishes, is aborted or
  moves (then a new `run` starts on the next worker), with one `step` event per plan that
  schedules it (step id, tokens) and a `preempted` event when it is preempted. Events, not
  spans, per step, so a long generation costs one span (the SDK keeps the first 128 events by
  default, `OTEL_SPAN_EVENT_COUNT_LIMIT`). Its context goes to the worker in
  `NewRequestData.traceparent`.

Exists only while tracing is on: the service holds None otherwise.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from shared.tracing import Tracer
from shared.wire import BatchPlan


@dataclass
class _Trace:
    parent: str  # the gateway's traceparent
    queue: Any  # open span, or None once the request ran
    run: Any = None  # open span on its current worker


class RequestTraces:
    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer
        self._traces: dict[str, _Trace] = {}

    def added(
        self, req_id: str, traceparent: str | None, worker_id: str | None, started_ns: int
    ) -> None:
        """A request admitted at `started_ns` and placed on `worker_id` (None: on none yet)."""
        if not traceparent:
            return
        queue = self.tracer.start("queue", parent=traceparent, start_time=started_ns)
        self._traces[req_id] = _Trace(traceparent, queue)
        attributes = {"skiff.worker_id": worker_id or ""}
        place = self.tracer.start(
            "place", parent=traceparent, start_time=started_ns, attributes=attributes
        )
        place.end()

    def planned(self, plan: BatchPlan, worker_id: str) -> None:
        """A plan for `worker_id` is about to go out: start `run` spans of the requests new
        there (and put their context on the plan), add a `step` event to every traced one."""
        traces = self._traces
        if not traces:
            return
        for new in plan.new_reqs:
            trace = traces.get(new.req_id)
            if trace is None:
                continue
            if trace.queue is not None:
                trace.queue.end()
                trace.queue = None
            if trace.run is not None:
                trace.run.set_attribute("skiff.moved", True)
                trace.run.end()
            trace.run = self.tracer.start(
                "run", parent=trace.parent, attributes={"skiff.worker_id": worker_id}
            )
            new.traceparent = self.tracer.traceparent(trace.run)
        now = time.time_ns()
        for req_id, num_tokens in plan.num_scheduled_tokens.items():
            trace = traces.get(req_id)
            if trace is not None and trace.run is not None:
                attributes = {"skiff.step_id": plan.step_id, "skiff.num_tokens": num_tokens}
                trace.run.add_event("step", attributes, now)
        for req_id in plan.preempted_req_ids:
            trace = traces.get(req_id)
            if trace is not None and trace.run is not None:
                trace.run.add_event("preempted", timestamp=now)

    def finished(self, req_id: str, reason: str) -> None:
        """The request finished (stop, length) or was aborted: end its spans."""
        trace = self._traces.pop(req_id, None)
        if trace is None:
            return
        for span in (trace.queue, trace.run):
            if span is not None:
                span.set_attribute("gen_ai.response.finish_reasons", [reason])
                span.end()
