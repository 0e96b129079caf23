"""NATS subject names; the prefix lets several deployments share one NATS server."""

from __future__ import annotations

import re
from dataclasses import dataclass

from shared.config import DEFAULT_SUBJECT_PREFIX

# One token of a subject (a gateway id, a part of the prefix): no dots, wildcards or spaces.
SUBJECT_TOKEN = re.compile(r"[A-Za-z0-9_-]+")
SUBJECT_PREFIX = re.compile(rf"{SUBJECT_TOKEN.pattern}(\.{SUBJECT_TOKEN.pattern})*")


@dataclass(frozen=True)
class Subjects:
    prefix: str = DEFAULT_SUBJECT_PREFIX

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
