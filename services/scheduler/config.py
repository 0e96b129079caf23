"""The scheduler service's configuration: a frozen dataclass validated at construction, from
which the flags and SKIFF_* variables of `skiff scheduler` derive (`shared.cli_args`); the
scheduling limits themselves are `shared.config.SchedulerConfig`."""

from __future__ import annotations

from dataclasses import dataclass

from services.scheduler.lora_registry import parse_lora_modules
from shared.cli_args import setting
from shared.config import (
    DEFAULT_LOG_LEVEL,
    DEFAULT_SUBJECT_PREFIX,
    NatsClientConfig,
    check_positive,
)
from shared.prefix_summary import DEFAULT_MAX_BYTES, MIN_MAX_BYTES


@dataclass(frozen=True)
class SchedulerServiceConfig(NatsClientConfig):
    """The scheduler service: NATS, admission limits, liveness of workers and gateways."""

    subject_prefix: str = setting(DEFAULT_SUBJECT_PREFIX, "prefix of every NATS subject")
    served_model_name: str = setting("", "label of the vllm:* metrics")
    max_waiting: int = setting(1024, "queued requests beyond this are refused with 429")
    heartbeat_interval: float = setting(0.5, "seconds between scheduler heartbeats")
    prefix_summary_max_bytes: int = setting(
        DEFAULT_MAX_BYTES,
        "size cap of the summary of the workers' KV blocks in each heartbeat, by which "
        "gateways route a prompt to the shard holding its longest prefix",
    )
    worker_timeout: float = setting(5.0, "a worker silent this long is declared lost")
    step_timeout: float = setting(
        20.0,
        "a step's result is due within this plus --step-timeout-per-token per scheduled "
        "token, counted again from each heartbeat reporting progress on it; a worker that "
        "misses it gets no requests until it answers a probe",
    )
    step_timeout_per_token: float = setting(
        0.01, "seconds added to a step's deadline per scheduled token"
    )
    max_request_failures: int = setting(
        2,
        "a request in the steps in flight of this many workers that missed a step deadline "
        "or were lost (heartbeats gone, or a failed step) ends with an error (422) instead "
        "of being re-placed again",
    )
    gateway_timeout: float = setting(15.0, "abort the requests of a gateway silent this long")
    lora_modules: str = setting(
        "",
        "LoRA adapters served from the start, name=path separated by spaces or commas "
        "(vLLM's --lora-modules; the workers need --enable-lora); a request names one as its "
        "model",
    )
    lora_root: str = setting(
        "",
        "directory adapters loaded at run time (POST /v1/load_lora_adapter) must lie in, "
        "relative paths taken from it (empty: runtime loading off)",
    )
    metrics_host: str = setting("127.0.0.1", "address of the /metrics, /health, /ready server")
    metrics_port: int = setting(
        0, "serve Prometheus /metrics, /health and /ready on this port (0: off)"
    )
    log_level: str = setting(DEFAULT_LOG_LEVEL, "DEBUG, INFO, WARNING or ERROR")
    # Leader election (services/scheduler/leader.py): replicas of one shard's scheduler.
    leader_election: bool = setting(
        False,
        "stand by until this scheduler holds its shard's coordination.k8s.io Lease, lead "
        "while it renews it, exit when it cannot (needs skiff[k8s])",
    )
    leader_election_lease_name: str = setting(
        "", "the shard's Lease (empty: <subject prefix>-scheduler)"
    )
    leader_election_namespace: str = setting(
        "", "namespace of the Lease (empty: this pod's, from its service account)"
    )
    leader_election_identity: str = setting(
        "", "this replica's name in the Lease, made unique per process (empty: host name)"
    )
    leader_election_lease_duration: float = setting(
        6.0, "a standby takes over a Lease not renewed for this long"
    )
    leader_election_renew_deadline: float = setting(
        4.0, "the leader exits when no renewal succeeded for this long"
    )
    leader_election_retry_period: float = setting(
        1.0, "seconds between tries to acquire or renew the Lease"
    )
    leader_election_lock_dir: str = setting(
        "",
        "tests and development only: keep the Leases as files in this directory instead of "
        "the Kubernetes API (schedulers on one host)",
    )

    def __post_init__(self) -> None:
        check_positive(self, "max_waiting")
        check_positive(self, "max_request_failures")
        parse_lora_modules(self.lora_modules)
        if self.prefix_summary_max_bytes < MIN_MAX_BYTES:
            raise ValueError(f"prefix_summary_max_bytes must be >= {MIN_MAX_BYTES}")
        timeouts = (self.worker_timeout, self.step_timeout, self.gateway_timeout)
        if min(self.heartbeat_interval, *timeouts) <= 0:
            raise ValueError("heartbeat interval and timeouts must be > 0")
        if self.step_timeout_per_token < 0:
            raise ValueError("step_timeout_per_token must be >= 0")
        lease = self.leader_election_lease_duration
        renew = self.leader_election_renew_deadline
        retry = self.leader_election_retry_period
        # the rules of kubernetes' leader election (its jitter factor is 1.2)
        if not lease > renew > 1.2 * retry >= 1.2:
            raise ValueError(
                "leader election needs lease duration > renew deadline > 1.2 x retry period "
                f"and retry period >= 1 s, got {lease}, {renew} and {retry}"
            )

    @property
    def lease_name(self) -> str:
        """The Lease the replicas of this shard's scheduler compete for."""
        return self.leader_election_lease_name or f"{self.subject_prefix}-scheduler"
