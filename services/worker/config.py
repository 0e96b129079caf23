"""The worker's configuration (its service, HTTP endpoint, model runner and simulated device):
frozen dataclasses, torch-free so that `skiff serve` and the flags of `skiff worker` can derive
from them without loading torch."""

from __future__ import annotations

from dataclasses import dataclass

from shared.cli_args import setting
from shared.config import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_LOG_LEVEL,
    DEFAULT_MAX_MODEL_LEN,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_SUBJECT_PREFIX,
    NatsClientConfig,
    check_positive,
)
from shared.wire import ROLE_MIXED, WORKER_ROLES

DTYPES = ("float32", "float16", "bfloat16")
# the CPU worker's projection weights (services/worker/weight_format.py); fp32 is exact
CPU_WEIGHT_FORMATS = ("fp32", "bf16", "bf16_dot", "int8", "q8_0")
SIM_DEVICE = "sim"  # RunnerConfig.device of a simulated worker (services/worker/sim_runner.py)


@dataclass(frozen=True)
class WorkerServiceConfig(NatsClientConfig):
    """The worker service: NATS and identity."""

    subject_prefix: str = setting(DEFAULT_SUBJECT_PREFIX, "prefix of every NATS subject")
    worker_id: str = setting("worker-0", "unique per worker (the pod name in Kubernetes)")
    served_model_name: str = setting("", "model name announced to the scheduler")
    scheduler_shards: int = setting(
        1, "scheduler shards; this worker serves the one its id's number selects (modulo)"
    )
    role: str = setting(
        ROLE_MIXED,
        "mixed: every request; prefill: only long prompts' prefill, decoded elsewhere; "
        "decode: decodes and short prompts (docs/disaggregation.md)",
    )
    heartbeat_interval: float = setting(1.0, "seconds between worker heartbeats")
    log_level: str = setting(DEFAULT_LOG_LEVEL, "DEBUG, INFO, WARNING or ERROR")
    # The KV-transfer server, where other workers fetch this worker's KV blocks
    kv_transfer_host: str = setting(
        "127.0.0.1", "address the KV-transfer server binds (0.0.0.0: every interface)"
    )
    kv_transfer_port: int = setting(0, "port of the KV-transfer server (0: any free port)")
    kv_transfer_advertise_host: str = setting(
        "", "host other workers reach the KV-transfer server at (default: the bind address)"
    )

    def __post_init__(self) -> None:
        if self.heartbeat_interval <= 0:
            raise ValueError("heartbeat interval must be > 0")
        check_positive(self, "scheduler_shards")
        if self.role not in WORKER_ROLES:
            raise ValueError(f"role must be one of {', '.join(WORKER_ROLES)}, got {self.role!r}")
        if not 0 <= self.kv_transfer_port <= 65535:
            raise ValueError(f"kv_transfer_port must be in [0, 65535], got {self.kv_transfer_port}")


@dataclass(frozen=True)
class RunnerConfig:
    """Everything a ModelRunner needs; each default is defined here once."""

    model_dir: str  # HF-format checkpoint directory (flag --model)
    kv_cache_gib: float = setting(1.0, "KV cache budget, GiB (when num_blocks is not given)")
    num_blocks: int | None = setting(
        None, f"KV blocks (default: sized from kv_cache_gib; {SIM_DEVICE}: an H200's, 8B model)"
    )
    block_size: int = setting(DEFAULT_BLOCK_SIZE, "tokens per KV block")
    max_num_seqs: int = setting(DEFAULT_MAX_NUM_SEQS, "rows of the persistent batch")
    max_model_len: int = setting(
        DEFAULT_MAX_MODEL_LEN, "context length cap (also capped by the model's)"
    )
    device: str = setting("cpu", f"torch device: cpu, cuda, cuda:N; {SIM_DEVICE}: simulated")
    dtype: str = setting("float32", f"weights and KV cache: {', '.join(DTYPES)}")
    cuda_graphs: bool = setting(True, "decode steps replay captured graphs (CUDA only)")
    fused_cpu_decode: bool = setting(
        True, "CPU decode steps run each layer as one fused C++ op (built once, cached on disk)"
    )
    cpu_weights: str = setting(
        "fp32",
        "CPU projection weights: fp32 (exact), bf16, bf16_dot (bf16 activations too), int8 "
        "or q8_0 (int8 activations too, a bf16 LM head; faster, outputs can differ)",
    )
    # LoRA adapters (docs/lora.md); the defaults are vLLM's
    enable_lora: bool = setting(False, "serve requests with LoRA adapters (PEFT checkpoints)")
    max_loras: int = setting(1, "LoRA adapters one step may use: the slots held on the device")
    max_lora_rank: int = setting(16, "the highest LoRA adapter rank accepted")
    # vLLM's --kv-offloading-size: KV blocks the scheduler moves below the device pool
    kv_offloading_size: float = setting(
        0.0, "host-memory KV tier, GiB (pinned on CUDA, RAM on the CPU; 0: off)"
    )
    kv_offloading_disk_size: float = setting(
        0.0, "local-disk KV tier below the host tier, GiB (0: off; needs the host tier)"
    )
    kv_offloading_disk_path: str = setting(
        "", "directory of the disk tier's file (required with --kv-offloading-disk-size)"
    )

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_model_len", "max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1 or None, got {self.num_blocks}")
        if not self.kv_cache_gib > 0:
            raise ValueError(f"kv_cache_gib must be > 0, got {self.kv_cache_gib}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.cpu_weights not in CPU_WEIGHT_FORMATS:
            raise ValueError(
                f"cpu_weights must be one of {', '.join(CPU_WEIGHT_FORMATS)}, "
                f"got {self.cpu_weights!r}"
            )
        if self.cpu_weights != "fp32" and (self.device != "cpu" or self.dtype != "float32"):
            raise ValueError("cpu_weights other than fp32 need device cpu and dtype float32")
        self._check_kv_tiers()

    def _check_kv_tiers(self) -> None:
        for name in ("kv_offloading_size", "kv_offloading_disk_size"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0 GiB, got {getattr(self, name)}")
        if self.kv_offloading_disk_size > 0:
            if not self.kv_offloading_size > 0:
                raise ValueError(
                    "kv_offloading_disk_size needs the host tier: set kv_offloading_size too"
                )
            if not self.kv_offloading_disk_path and self.device != SIM_DEVICE:
                raise ValueError(
                    "kv_offloading_disk_path: a directory is required with kv_offloading_disk_size"
                )


@dataclass(frozen=True)
class WorkerHttpConfig:
    """The worker's HTTP endpoint: /health (liveness: its event loop responds and no step is
    wedged), /ready (weights loaded and adopted by a scheduler) and /metrics. A step is wedged
    once it has made no progress (no decoder layer finished) for longer than
    execute_model_timeout and than execute_model_timeout_factor times the moving average of
    recent steps."""

    http_host: str = setting("127.0.0.1", "address of the /health, /ready and /metrics server")
    http_port: int = setting(0, "serve /health, /ready and /metrics on this port (0: off)")
    # vLLM's VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS is 300 too; the first steps' Triton compiles
    # take seconds, not minutes (weights and CUDA graphs load before /health turns 200).
    execute_model_timeout: float = setting(
        300.0, "a step without progress for longer than this (and the factor below) fails /health"
    )
    execute_model_timeout_factor: float = setting(
        20.0, "a step must also stall this many times the recent mean step time to fail /health"
    )

    def __post_init__(self) -> None:
        if not 0 <= self.http_port <= 65535:
            raise ValueError(f"http_port must be in [0, 65535], got {self.http_port}")
        if not self.execute_model_timeout > 0:
            raise ValueError(f"execute_model_timeout must be > 0, got {self.execute_model_timeout}")
        if not self.execute_model_timeout_factor >= 1:
            raise ValueError(
                "execute_model_timeout_factor must be >= 1, "
                f"got {self.execute_model_timeout_factor}"
            )


@dataclass(frozen=True)
class SimConfig:
    """A simulated worker (`--device sim`): no model, tokens from a hash. A step holds the
    simulated device for sim_step_base_ms + sim_per_token_us * scheduled tokens +
    sim_per_req_us * requests; the defaults model an 8B model in bf16 on one H200. KV loads
    from the lower tiers move their bytes at sim_kv_load_gbps, alongside the step."""

    # A small decode batch is memory-bound: ~16 GB of bf16 weights at ~4.8 TB/s is ~3.4 ms,
    # plus ~1.5 ms of kernel launches, sampling and host work.
    sim_step_base_ms: float = setting(5.0, "simulated step: fixed time, ms")
    # A token costs ~16 GFLOP (2 x 8B parameters): ~25 us at ~650 TFLOP/s of effective bf16
    # throughput; this term dominates prefill chunks.
    sim_per_token_us: float = setting(25.0, "simulated step: time per scheduled token, us")
    # Attention reads each request's KV: ~750 tokens of context at 128 KiB each (~94 MiB) at
    # ~4.8 TB/s is ~20 us. With the terms above a 256-request decode step takes ~16.5 ms.
    sim_per_req_us: float = setting(20.0, "simulated step: time per scheduled request, us")
    sim_eos_rate: float = setting(
        0.0, "chance that a sampled token is EOS (never before min_tokens)"
    )
    # One H200's host link: PCIe 5.0 x16 moves ~25 GB/s of pinned memory each way.
    sim_kv_load_gbps: float = setting(
        25.0, "simulated KV loads into the device pool (any tier), GB/s"
    )

    def __post_init__(self) -> None:
        for name in ("sim_step_base_ms", "sim_per_token_us", "sim_per_req_us"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.sim_eos_rate <= 1.0:
            raise ValueError(f"sim_eos_rate must be in [0, 1], got {self.sim_eos_rate}")
        if not self.sim_kv_load_gbps > 0:
            raise ValueError(f"sim_kv_load_gbps must be > 0, got {self.sim_kv_load_gbps}")

    def step_time_s(self, num_scheduled_tokens: int, num_reqs: int) -> float:
        """How long a step of this size holds the simulated device (0 for an empty plan)."""
        if not num_reqs:
            return 0.0
        variable_us = self.sim_per_token_us * num_scheduled_tokens + self.sim_per_req_us * num_reqs
        return self.sim_step_base_ms * 1e-3 + variable_us * 1e-6
