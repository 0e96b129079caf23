"""The gateway's configuration: one frozen dataclass; flags and SKIFF_* variables derive from it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import msgspec

from services.gateway.shards import ROUTINGS
from services.gateway.tool_parsers import TOOL_PARSERS
from shared.cli_args import setting
from shared.config import DEFAULT_LOG_LEVEL, DEFAULT_SUBJECT_PREFIX, NatsClientConfig
from shared.default_model import DEFAULT_MODEL_NAME, default_model_dir
from shared.subjects import SUBJECT_PREFIX, SUBJECT_TOKEN

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024


class ModelRoute(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A model the gateway serves: its name in the API, the directory of its tokenizer files,
    and the subject prefix and shard count of its schedulers (None: the context length its
    schedulers announce)."""

    name: str
    model_dir: str
    subject_prefix: str
    scheduler_shards: int = 1
    max_model_len: int | None = None


def parse_extra_models(text: str) -> list[ModelRoute]:
    """The `extra_models` setting: a JSON list of `ModelRoute` objects ("": none)."""
    if not text.strip():
        return []
    try:
        return msgspec.json.decode(text, type=list[ModelRoute])
    except msgspec.DecodeError as e:  # ValidationError included
        raise ValueError(f"extra_models: {e}") from None


@dataclass(frozen=True)
class GatewayConfig(NatsClientConfig):
    """The gateway: HTTP, its model's tokenizer, and its NATS link to the scheduler shards."""

    subject_prefix: str = setting(DEFAULT_SUBJECT_PREFIX, "prefix of every NATS subject")
    scheduler_shards: int = setting(1, "scheduler shards to spread requests over")
    shard_routing: str = setting(
        "prefix",
        "prefix: a request goes to the shard whose workers hold the longest prefix of its "
        "prompt (by the summary in each shard's heartbeat), else by load; load: to the shard "
        "with the fewest requests per ready worker",
    )
    shard_routing_max_imbalance: float = setting(
        4.0,
        "prefix routing goes by load instead when the shard holding the longest prefix has "
        "this many more requests per ready worker than the least loaded shard",
    )
    host: str = setting("127.0.0.1", "HTTP listen address (0.0.0.0: every interface)")
    port: int = setting(8000, "HTTP port")
    model_dir: str | None = setting(
        None, "model directory with tokenizer.json (default: the embedded model)"
    )
    served_model_name: str | None = setting(None, "model name in the API (default: the dir's)")
    api_key: str | None = setting(
        None, "require this bearer token: an unlimited admin tenant (default: no auth)"
    )
    api_keys_file: str | None = setting(
        None,
        "JSON file of tenants: name, key_sha256 (skiff hash-key), optional "
        "requests_per_minute, tokens_per_minute, max_concurrency, models, admin",
    )
    gateway_id: str | None = setting(None, "NATS identity of this gateway (default: random)")
    max_model_len: int | None = setting(None, "context length (default: the scheduler's)")
    max_body_bytes: int = setting(DEFAULT_MAX_BODY_BYTES, "largest request body accepted")
    drain_timeout: float = setting(30.0, "on SIGTERM, seconds in-flight streams may finish")
    scheduler_timeout: float = setting(
        10.0,
        "seconds a request waits for a scheduler (a new one for a new request, its shard's "
        "heartbeat for one in flight) before it fails with 503",
    )
    heartbeat_timeout: float = setting(
        1.5, "a scheduler shard silent this long is unavailable (/health 503)"
    )
    keepalive_interval: float = setting(
        10.0, "SSE comment sent on a stream that waits this long for tokens (0: never)"
    )
    header_timeout: float = setting(
        10.0, "seconds a client may take to send a request's headers (or to send anything)"
    )
    body_timeout: float = setting(30.0, "seconds a client may take to send a request's body")
    limit_concurrency: int = setting(4096, "open connections and requests; past it, 503")
    tokenizer_concurrency: int = setting(2, "long prompts tokenized at once (in threads)")
    model_wait_timeout: float = setting(0.0, "wait this long for the tokenizer files to appear")
    tool_call_parser: str | None = setting(
        None,
        "format of the model's own tool calls, parsed for tool_choice auto: "
        + ", ".join(TOOL_PARSERS)
        + " (default: the one its chat template suggests, else hermes)",
    )
    extra_models: str = setting(
        "",
        "more models served beside this one, each by its own schedulers and workers: a JSON "
        'list of {"name", "model_dir" (its tokenizer files), "subject_prefix", '
        '"scheduler_shards" (1), "max_model_len" (its schedulers\')}; a request names one as '
        "its model (docs/models.md)",
    )
    log_level: str = setting(DEFAULT_LOG_LEVEL, "DEBUG, INFO, WARNING or ERROR")

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.scheduler_shards < 1:
            raise ValueError("scheduler_shards must be >= 1")
        if self.shard_routing not in ROUTINGS:
            raise ValueError(f"shard_routing must be prefix or load, got {self.shard_routing!r}")
        if self.shard_routing_max_imbalance < 0:
            raise ValueError("shard_routing_max_imbalance must be >= 0")
        if self.max_body_bytes < 1:
            raise ValueError("max_body_bytes must be >= 1")
        if min(self.drain_timeout, self.model_wait_timeout, self.keepalive_interval) < 0:
            raise ValueError("timeouts must be >= 0")
        timeouts = (self.scheduler_timeout, self.heartbeat_timeout, self.header_timeout)
        if min(*timeouts, self.body_timeout) <= 0:
            raise ValueError("scheduler, heartbeat, header and body timeouts must be > 0")
        if min(self.limit_concurrency, self.tokenizer_concurrency) < 1:
            raise ValueError("limit_concurrency and tokenizer_concurrency must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("max_model_len must be >= 1")
        if self.gateway_id is not None and not SUBJECT_TOKEN.fullmatch(self.gateway_id):
            raise ValueError(f"gateway id must be letters, digits, '_' or '-': {self.gateway_id!r}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            known = ", ".join(TOOL_PARSERS)
            raise ValueError(f"unknown tool call parser {self.tool_call_parser!r} (known: {known})")
        if not SUBJECT_PREFIX.fullmatch(self.subject_prefix):
            raise ValueError(f"invalid NATS subject prefix: {self.subject_prefix!r}")
        _check_routes(self.models)

    @property
    def resolved_model_dir(self) -> Path:
        return Path(self.model_dir) if self.model_dir else default_model_dir()

    @property
    def models(self) -> list[ModelRoute]:
        """Every model served: this config's own first, then `extra_models`."""
        own = ModelRoute(
            self.resolved_model_name,
            str(self.resolved_model_dir),
            self.subject_prefix,
            self.scheduler_shards,
            self.max_model_len,
        )
        return [own, *parse_extra_models(self.extra_models)]

    def for_model(self, route: ModelRoute) -> GatewayConfig:
        """This config, serving `route` alone (what its engine client and context use)."""
        return dataclasses.replace(
            self,
            served_model_name=route.name,
            model_dir=route.model_dir,
            subject_prefix=route.subject_prefix,
            scheduler_shards=route.scheduler_shards,
            max_model_len=route.max_model_len,
            extra_models="",
        )

    @property
    def resolved_model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return self.resolved_model_dir.name if self.model_dir else DEFAULT_MODEL_NAME


def _check_routes(routes: list[ModelRoute]) -> None:
    """Names and subject prefixes are each one model's; prefixes and shard counts valid."""
    for route in routes[1:]:
        if not route.name:
            raise ValueError("extra_models: every model needs a name")
        if not SUBJECT_PREFIX.fullmatch(route.subject_prefix):
            raise ValueError(f"extra_models: invalid NATS subject prefix {route.subject_prefix!r}")
        if route.scheduler_shards < 1 or (route.max_model_len or 1) < 1:
            raise ValueError(f"extra_models: {route.name}: shards and max_model_len must be >= 1")
    for what in ("name", "subject_prefix"):
        values = [getattr(r, what) for r in routes]
        if len(set(values)) != len(values):
            raise ValueError(f"extra_models: two models have the same {what}: {values}")
