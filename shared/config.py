"""Configuration of the scheduler and the worker service: frozen dataclasses validated at
construction. Each default is defined here once; `shared.cli_args` derives the flags and
`SKIFF_*` variables of `skiff scheduler`, `skiff worker` and `skiff serve` from these fields.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.cli_args import setting
from shared.logs import LOG_FORMATS
from shared.tracing import traces_url

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
DEFAULT_SUBJECT_PREFIX = "skiff"
DEFAULT_LOG_LEVEL = "INFO"
DEFAULT_BLOCK_SIZE = 16  # tokens per KV block
DEFAULT_MAX_NUM_SEQS = 256
# A cap: each worker also caps it at its model's max_position_embeddings, and the scheduler
# uses the smallest of its own value and every worker's.
DEFAULT_MAX_MODEL_LEN = 8192


def _check_positive(config: object, *names: str) -> None:
    for name in names:
        if getattr(config, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(config, name)}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one scheduling step and of the KV block pool of one worker."""

    max_num_batched_tokens: int = setting(2048, "tokens scheduled per step, all requests")
    max_num_seqs: int = setting(
        DEFAULT_MAX_NUM_SEQS, "requests per step (each worker's own limit also applies)"
    )
    max_model_len: int = setting(DEFAULT_MAX_MODEL_LEN, "context length cap, prompt + output")
    # Set per worker from its WorkerHello; not a scheduler flag.
    block_size: int = setting(DEFAULT_BLOCK_SIZE, "tokens per KV block", cli=False)
    enable_prefix_caching: bool = setting(True, "reuse KV blocks of shared prompt prefixes")
    async_scheduling: bool = setting(
        True, "plan step N+1 while step N runs: up to two plans in flight per worker"
    )

    def __post_init__(self) -> None:
        _check_positive(self, "max_num_batched_tokens", "max_num_seqs", "max_model_len")
        _check_positive(self, "block_size")


@dataclass(frozen=True)
class NatsClientConfig:
    """How a service reaches NATS: URL, user and TLS (every service's config extends this).
    The password comes from `nats_password_file`, else from SKIFF_NATS_PASSWORD, never a flag."""

    nats_url: str = setting(DEFAULT_NATS_URL, "NATS server URL")
    nats_user: str = setting("", "NATS user name (empty: connect without credentials)")
    nats_password_file: str = setting(
        "", "file holding the NATS user's password (else SKIFF_NATS_PASSWORD)"
    )
    nats_tls_ca: str = setting("", "CA file that signed the NATS server's certificate: use TLS")
    nats_tls_cert: str = setting("", "client certificate for NATS TLS (with nats_tls_key)")
    nats_tls_key: str = setting("", "private key of nats_tls_cert")


@dataclass(frozen=True)
class SchedulerServiceConfig(NatsClientConfig):
    """The scheduler service: NATS, admission limits, liveness of workers and gateways."""

    subject_prefix: str = setting(DEFAULT_SUBJECT_PREFIX, "prefix of every NATS subject")
    model_name: str = setting("", "label of the vllm:* metrics", name="served_model_name")
    max_waiting: int = setting(1024, "queued requests beyond this are refused with 429")
    heartbeat_interval_s: float = setting(
        0.5, "seconds between scheduler heartbeats", name="heartbeat_interval"
    )
    worker_timeout_s: float = setting(
        5.0, "a worker silent this long is declared lost", name="worker_timeout"
    )
    step_timeout_s: float = setting(
        20.0,
        "a step's result is due within this plus --step-timeout-per-token per scheduled "
        "token; a worker that misses it gets no requests until it answers a probe",
        name="step_timeout",
    )
    step_timeout_per_token_s: float = setting(
        0.01,
        "seconds added to a step's deadline per scheduled token",
        name="step_timeout_per_token",
    )
    gateway_timeout_s: float = setting(
        15.0, "abort the requests of a gateway silent this long", name="gateway_timeout"
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
        "", "this replica's name in the Lease (empty: host name and process id)"
    )
    leader_election_lease_duration_s: float = setting(
        6.0,
        "a standby takes over a Lease not renewed for this long",
        name="leader_election_lease_duration",
    )
    leader_election_renew_deadline_s: float = setting(
        4.0,
        "the leader exits when no renewal succeeded for this long",
        name="leader_election_renew_deadline",
    )
    leader_election_retry_period_s: float = setting(
        1.0,
        "seconds between tries to acquire or renew the Lease",
        name="leader_election_retry_period",
    )
    leader_election_lock_dir: str = setting(
        "",
        "tests and development only: keep the Leases as files in this directory instead of "
        "the Kubernetes API (schedulers on one host)",
    )

    def __post_init__(self) -> None:
        _check_positive(self, "max_waiting")
        timeouts = (self.worker_timeout_s, self.step_timeout_s, self.gateway_timeout_s)
        if min(self.heartbeat_interval_s, *timeouts) <= 0:
            raise ValueError("heartbeat interval and timeouts must be > 0")
        if self.step_timeout_per_token_s < 0:
            raise ValueError("step_timeout_per_token must be >= 0")
        lease = self.leader_election_lease_duration_s
        renew = self.leader_election_renew_deadline_s
        retry = self.leader_election_retry_period_s
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


@dataclass(frozen=True)
class WorkerServiceConfig(NatsClientConfig):
    """The worker service: NATS and identity."""

    subject_prefix: str = setting(DEFAULT_SUBJECT_PREFIX, "prefix of every NATS subject")
    worker_id: str = setting("worker-0", "unique per worker (the pod name in Kubernetes)")
    model_name: str = setting("", "model name announced to the scheduler", name="served_model_name")
    scheduler_shards: int = setting(
        1, "scheduler shards; this worker serves the one its id's number selects (modulo)"
    )
    heartbeat_interval_s: float = setting(
        1.0, "seconds between worker heartbeats", name="heartbeat_interval"
    )
    log_level: str = setting(DEFAULT_LOG_LEVEL, "DEBUG, INFO, WARNING or ERROR")

    def __post_init__(self) -> None:
        if self.heartbeat_interval_s <= 0:
            raise ValueError("heartbeat interval must be > 0")
        _check_positive(self, "scheduler_shards")


@dataclass(frozen=True)
class TelemetryConfig:
    """Logs and traces of every service (`shared.logs`, `shared.tracing`)."""

    log_format: str = setting("text", "log lines as text, or json (one object per line)")
    otlp_traces_endpoint: str = setting(
        "", "send OpenTelemetry traces to this OTLP/HTTP URL (empty: tracing off; skiff[otel])"
    )

    def __post_init__(self) -> None:
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"log_format must be text or json, got {self.log_format!r}")
        if self.otlp_traces_endpoint:
            traces_url(self.otlp_traces_endpoint)  # raises ValueError on a malformed URL
