"""Configuration shared by the services: frozen dataclasses validated at construction."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one scheduling step and of the KV block pool of one worker."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 2048
    block_size: int = 16
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class SchedulerServiceConfig:
    """The scheduler service: NATS, admission limits, liveness and drain timeouts."""

    nats_url: str = "nats://127.0.0.1:4222"
    subject_prefix: str = "skiff"
    model_name: str = ""  # label of the vllm:* metrics
    max_waiting: int = 1024  # queued requests beyond this are refused with 429
    heartbeat_interval_s: float = 0.5
    worker_timeout_s: float = 5.0  # a worker silent this long is declared lost
    step_timeout_s: float = 120.0  # a step result this late: the plan or result was lost
    drain_timeout_s: float = 30.0


@dataclass(frozen=True)
class WorkerServiceConfig:
    """The worker service: NATS and identity."""

    nats_url: str = "nats://127.0.0.1:4222"
    subject_prefix: str = "skiff"
    worker_id: str = "worker-0"
    model_name: str = ""
    heartbeat_interval_s: float = 1.0
