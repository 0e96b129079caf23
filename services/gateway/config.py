"""The gateway's configuration: one frozen dataclass; flags and SKIFF_* variables derive from it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shared.cli_args import setting
from shared.config import DEFAULT_LOG_LEVEL, DEFAULT_NATS_URL, DEFAULT_SUBJECT_PREFIX
from shared.default_model import DEFAULT_MODEL_NAME, default_model_dir
from shared.subjects import SUBJECT_PREFIX, SUBJECT_TOKEN

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024


@dataclass(frozen=True)
class GatewayConfig:
    """The gateway: HTTP, its model's tokenizer, and its NATS link to the scheduler shards."""

    nats_url: str = setting(DEFAULT_NATS_URL, "NATS server URL")
    subject_prefix: str = setting(DEFAULT_SUBJECT_PREFIX, "prefix of every NATS subject")
    scheduler_shards: int = setting(1, "scheduler shards to spread requests over")
    host: str = setting("0.0.0.0", "HTTP listen address")
    port: int = setting(8000, "HTTP port")
    model_dir: str | None = setting(
        None, "model directory with tokenizer.json (default: the embedded model)"
    )
    served_model_name: str | None = setting(None, "model name in the API (default: the dir's)")
    api_key: str | None = setting(None, "require this bearer token (default: no auth)")
    gateway_id: str | None = setting(None, "NATS identity of this gateway (default: random)")
    max_model_len: int | None = setting(None, "context length (default: the scheduler's)")
    max_body_bytes: int = setting(DEFAULT_MAX_BODY_BYTES, "largest request body accepted")
    drain_timeout: float = setting(30.0, "on SIGTERM, seconds in-flight streams may finish")
    model_wait_timeout: float = setting(0.0, "wait this long for the tokenizer files to appear")
    log_level: str = setting(DEFAULT_LOG_LEVEL, "DEBUG, INFO, WARNING or ERROR")

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.scheduler_shards < 1:
            raise ValueError("scheduler_shards must be >= 1")
        if self.max_body_bytes < 1:
            raise ValueError("max_body_bytes must be >= 1")
        if self.drain_timeout < 0 or self.model_wait_timeout < 0:
            raise ValueError("timeouts must be >= 0")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("max_model_len must be >= 1")
        if self.gateway_id is not None and not SUBJECT_TOKEN.fullmatch(self.gateway_id):
            raise ValueError(f"gateway id must be letters, digits, '_' or '-': {self.gateway_id!r}")
        if not SUBJECT_PREFIX.fullmatch(self.subject_prefix):
            raise ValueError(f"invalid NATS subject prefix: {self.subject_prefix!r}")

    @property
    def resolved_model_dir(self) -> Path:
        return Path(self.model_dir) if self.model_dir else default_model_dir()

    @property
    def resolved_model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return self.resolved_model_dir.name if self.model_dir else DEFAULT_MODEL_NAME
