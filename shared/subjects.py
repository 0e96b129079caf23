"""NATS subject names; the prefix lets several deployments share one NATS server."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Subjects:
    prefix: str = "skiff"

    @property
    def submit(self) -> str:  # gateway -> scheduler, request-reply: SubmitRequest/SubmitReply
        return f"{self.prefix}.req.submit"

    @property
    def abort(self) -> str:  # gateway -> scheduler: AbortRequests
        return f"{self.prefix}.req.abort"

    def output(self, gateway_id: str) -> str:  # scheduler -> gateway: OutputBatch
        return f"{self.prefix}.out.{gateway_id}"

    def plan(self, worker_id: str) -> str:  # scheduler -> worker: BatchPlan
        return f"{self.prefix}.worker.{worker_id}.plan"

    @property
    def result(self) -> str:  # worker -> scheduler: ModelRunnerOutput
        return f"{self.prefix}.worker.result"

    @property
    def worker_hello(self) -> str:  # worker -> scheduler: WorkerHello
        return f"{self.prefix}.worker.hello"

    @property
    def worker_heartbeat(self) -> str:  # worker -> scheduler: WorkerHello
        return f"{self.prefix}.worker.heartbeat"

    @property
    def scheduler_heartbeat(self) -> str:  # scheduler -> all: SchedulerHeartbeat
        return f"{self.prefix}.scheduler.heartbeat"

    @property
    def scheduler_stats(self) -> str:  # request-reply: SchedulerStatsRequest/SchedulerStats
        return f"{self.prefix}.scheduler.stats"
