"""NATS subject names; the prefix lets several deployments share one NATS server.

Scheduling scales out by shards: shard i is one scheduler and the workers it owns, talking on
subjects of their own prefix (`<prefix>.shard<i>`); gateways talk to every shard. With one
shard the prefix is used as it is.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass

from shared.config import DEFAULT_SUBJECT_PREFIX

# One token of a subject (a gateway id, a part of the prefix): no dots, wildcards or spaces.
SUBJECT_TOKEN = re.compile(r"[A-Za-z0-9_-]+")
SUBJECT_PREFIX = re.compile(rf"{SUBJECT_TOKEN.pattern}(\.{SUBJECT_TOKEN.pattern})*")
_TRAILING_NUMBER = re.compile(r"(\d+)$")
ANY_WORKER = "*"  # the worker id token of a subscription to every worker's subjects


def shard_prefixes(prefix: str, num_shards: int) -> list[str]:
    """The subject prefix of each scheduler shard."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    if num_shards == 1:
        return [prefix]
    return [f"{prefix}.shard{i}" for i in range(num_shards)]


def worker_shard(worker_id: str, num_shards: int) -> int:
    """The shard that owns a worker: the number its id ends with (a StatefulSet ordinal as in
    `skiff-worker-3`, or `worker-3`) modulo the shard count, so consecutive workers alternate;
    a stable hash of the id when it ends in no number."""
    match = _TRAILING_NUMBER.search(worker_id)
    number = int(match.group(1)) if match else zlib.crc32(worker_id.encode())
    return number % num_shards


def worker_prefix(prefix: str, worker_id: str, num_shards: int) -> str:
    """The subject prefix a worker talks on: its shard's."""
    return shard_prefixes(prefix, num_shards)[worker_shard(worker_id, num_shards)]


def sender(subject: str) -> str:
    """The worker id a worker -> scheduler subject (`<prefix>.worker.<id>.<kind>`) names."""
    return subject.rsplit(".", 2)[-2]


@dataclass(frozen=True)
class Subjects:
    prefix: str = DEFAULT_SUBJECT_PREFIX

    @property
    def submit(self) -> str:  # gateway -> scheduler, request-reply: SubmitRequest/SubmitReply
        return f"{self.prefix}.req.submit"

    @property
    def lora_adapters(self) -> str:  # gateway -> scheduler, request-reply: LoRAAdapterChange
        return f"{self.prefix}.lora.adapters"

    @property
    def abort(self) -> str:  # gateway -> scheduler: AbortRequests
        return f"{self.prefix}.req.abort"

    def output(self, gateway_id: str) -> str:  # scheduler -> gateway: OutputBatch
        return f"{self.prefix}.out.{gateway_id}"

    def plan(self, worker_id: str) -> str:  # scheduler -> worker: BatchPlan
        return f"{self.prefix}.worker.{worker_id}.plan"

    def lora_check(self, worker_id: str) -> str:  # scheduler -> worker, request-reply: LoRACheck
        return f"{self.prefix}.worker.{worker_id}.lora_check"

    # Worker -> scheduler, on subjects of the sender's own id (`ANY_WORKER`: the scheduler's
    # wildcard), so NATS permissions let a worker speak only as itself.
    def result(self, worker_id: str) -> str:  # ModelRunnerOutput
        return f"{self.prefix}.worker.{worker_id}.result"

    def worker_hello(self, worker_id: str) -> str:  # WorkerHello
        return f"{self.prefix}.worker.{worker_id}.hello"

    def worker_heartbeat(self, worker_id: str) -> str:  # WorkerHello
        return f"{self.prefix}.worker.{worker_id}.heartbeat"

    def worker_goodbye(self, worker_id: str) -> str:  # WorkerGoodbye
        return f"{self.prefix}.worker.{worker_id}.goodbye"

    @property
    def scheduler_heartbeat(self) -> str:  # scheduler -> all: SchedulerHeartbeat
        return f"{self.prefix}.scheduler.heartbeat"

    @property
    def gateway_heartbeat(self) -> str:  # gateway -> schedulers: GatewayHeartbeat
        return f"{self.prefix}.gateway.heartbeat"

    @property
    def scheduler_stats(self) -> str:  # request-reply: SchedulerStatsRequest/SchedulerStats
        return f"{self.prefix}.scheduler.stats"
