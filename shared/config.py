"""What every service's configuration shares: the defaults used by more than one service, the
scheduling limits (`SchedulerConfig`: the scheduler's, the offline `LLM`'s, and `skiff serve`'s
for its workers), the NATS client and telemetry. Frozen dataclasses validated at construction;
`shared.cli_args` derives the flags and `SKIFF_*` variables from their fields. Each service's
own config lives in its package (`services/<service>/config.py`).
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
SCHEDULING_POLICIES = ("fcfs", "priority")


def check_positive(config: object, *names: str) -> None:
    """Raise ValueError unless each field `names` of `config` is >= 1."""
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
    scheduling_policy: str = setting(
        "fcfs",
        "fcfs: first come, first served; priority: by each request's priority (lower first), "
        "then arrival, and preempt the lowest priority first",
    )
    long_prefill_token_threshold: int = setting(
        0,
        "a request with more tokens than this is a long prefill, its chunks sized by the "
        "worker's measured step times (0: 4 percent of the context length)",
    )
    long_prefill_step_time: float = setting(
        0.5,
        "seconds a step's long prefill chunks may add to the step's fixed cost (reading the "
        "weights), in all (0: no limit)",
    )
    long_prefill_share: float = setting(
        0.5,
        "while other requests decode, long prefill chunks get at most this share of a "
        "step's time (1: no limit)",
    )
    disaggregation_threshold: int = setting(
        512,
        "a prompt with more uncached tokens than this is prefilled on a prefill worker and "
        "decoded on a decode worker, when the shard has both (docs/disaggregation.md)",
    )

    max_loras: int = setting(
        0, "LoRA adapters one worker's steps may hold at once (its hello's; 0: none)", cli=False
    )

    def __post_init__(self) -> None:
        check_positive(self, "max_num_batched_tokens", "max_num_seqs", "max_model_len")
        check_positive(self, "block_size")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be fcfs or priority, got {self.scheduling_policy!r}"
            )
        if self.disaggregation_threshold < 0:
            raise ValueError(
                f"disaggregation_threshold must be >= 0, got {self.disaggregation_threshold}"
            )
        if self.long_prefill_token_threshold < 0 or self.long_prefill_step_time < 0:
            raise ValueError("long_prefill_token_threshold and long_prefill_step_time must be >= 0")
        if not 0 < self.long_prefill_share <= 1:
            raise ValueError(f"long_prefill_share must be in (0, 1], got {self.long_prefill_share}")


@dataclass(frozen=True)
class NatsClientConfig:
    """How a service reaches NATS: URL, user and TLS (every service's config extends this).
    The password comes from `nats_password_file`, else from SKIFF_NATS_PASSWORD, never a flag;
    behind the auth callout a service presents its service-account token instead."""

    nats_url: str = setting(DEFAULT_NATS_URL, "NATS server URL")
    nats_user: str = setting(
        "",
        "NATS user name (empty: connect without credentials); with nats_token_file, the name "
        "the auth callout gives this pod (its pod name), which names its reply inboxes",
    )
    nats_password_file: str = setting(
        "", "file holding the NATS user's password (else SKIFF_NATS_PASSWORD)"
    )
    nats_token_file: str = setting(
        "",
        "file holding this pod's service-account token for the NATS auth callout (a projected "
        "token with the NATS audience; read again at every reconnection, as it rotates)",
    )
    nats_tls_ca: str = setting("", "CA file that signed the NATS server's certificate: use TLS")
    nats_tls_cert: str = setting("", "client certificate for NATS TLS (with nats_tls_key)")
    nats_tls_key: str = setting("", "private key of nats_tls_cert")


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
