"""The worker's spans (only when `shared.tracing` is on):

* `batch`, per traced request (one whose `NewRequestData` came with a `traceparent`): its time
  in this worker's persistent batch, a child of the scheduler's `run` span, so the request's
  trace reaches the worker; it ends when the request finishes or the batch is reset.
* `step`, per step that runs at least one traced request: the batch's request and token
  counts, linked to the `batch` span of every traced request in it. A step serves many
  requests of many traces, so it is the root of its own trace rather than anyone's child.
"""

from __future__ import annotations

from typing import Any

from shared.tracing import Tracer
from shared.wire import BatchPlan


class BatchTraces:
    def __init__(self, tracer: Tracer, worker_id: str) -> None:
        self.tracer = tracer
        self.worker_id = worker_id
        self._batch: dict[str, Any] = {}  # req_id -> open `batch` span
        self._step: Any = None  # the open `step` span

    def step(self, plan: BatchPlan) -> None:
        """Update the `batch` spans from `plan` and start its `step` span if a traced request
        runs in it."""
        spans = self._batch
        for new in plan.new_reqs:
            if new.traceparent and new.req_id not in spans:
                spans[new.req_id] = self.tracer.start(
                    "batch",
                    parent=new.traceparent,
                    attributes={"gen_ai.request.id": new.req_id, "skiff.worker_id": self.worker_id},
                )
        for req_id in plan.finished_req_ids:
            span = spans.pop(req_id, None)
            if span is not None:
                span.end()
        for req_id in plan.preempted_req_ids:
            if req_id in spans:
                spans[req_id].add_event("preempted")
        traced = [spans[r].get_span_context() for r in plan.num_scheduled_tokens if r in spans]
        if traced:
            self._step = self.tracer.start(
                "step",
                links=traced,
                attributes={
                    "skiff.worker_id": self.worker_id,
                    "skiff.step_id": plan.step_id,
                    "skiff.num_reqs": len(plan.num_scheduled_tokens),
                    "skiff.num_tokens": plan.total_num_scheduled_tokens,
                    "skiff.num_traced_reqs": len(traced),
                },
            )

    def step_done(self) -> None:
        if self._step is not None:
            self._step.end()
            self._step = None

    def reset(self) -> None:
        """The batch was dropped (new scheduler session, failed step)."""
        self.step_done()
        for span in self._batch.values():
            span.end()
        self._batch.clear()
