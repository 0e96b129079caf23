"""Typed wire messages between gateway, scheduler and worker (MessagePack via msgspec).

Every message is a `msgspec.Struct` with a `version` tag so that a service can refuse a
message from an incompatible peer instead of misreading it. No pickle anywhere.
"""

from __future__ import annotations

from typing import Any, TypeVar, cast

import msgspec

from shared.sampling_params import SamplingParams

# 2: WorkerHello.max_num_seqs, BatchPlan.worker_session, typed stats
# 3: BatchPlan.scheduler_epoch, no longer a prefix of BatchPlan.worker_session
# 4: WorkerHello.step_id and .progress (a long step is not hung while it advances), and
#    TokenDelta.finish_reason "error" with TokenDelta.error (a request failed by the scheduler)
# 5: tiered KV cache: BatchPlan.kv_copies and .kv_loads, their results in ModelRunnerOutput,
#    a worker's lower tiers and KV-transfer address in WorkerHello, SchedulerHeartbeat.block_size
#    and .prefix_summary
# 6: WorkerHello.role (prefill/decode disaggregation)
# 7: LoRA adapters: NewRequestData.lora, SubmitRequest.lora_name, WorkerHello.max_loras and
#    .max_lora_rank, SchedulerHeartbeat.lora_adapters, LoRAAdapterChange/LoRAAdapterReply,
#    LoRACheck, ModelRunnerOutput.failed_reqs
PROTOCOL_VERSION = 7
M = TypeVar("M", bound=msgspec.Struct)


class LoRARequest(msgspec.Struct, kw_only=True, frozen=True):
    """A LoRA adapter a request runs with: its name (the `model` an API client sends) and its
    PEFT checkpoint directory (`adapter_config.json`, `adapter_model.safetensors`) as the
    workers see it; an adapter loaded at run time carries the adapter root too, which the
    worker checks with symlinks followed (the scheduler checks the path as a string)."""

    lora_name: str
    lora_path: str
    root: str = ""  # a runtime load's adapter root: its files must resolve inside it


class NewRequestData(msgspec.Struct, kw_only=True):
    """A request the worker does not hold yet, sent in full.

    `output_token_ids` is non-empty only for a request that moves to this worker (or is
    resubmitted) after it already generated tokens; those tokens are part of the context.
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    output_token_ids: list[int] = []
    # W3C trace context of the scheduler's span of this request on this worker (tracing on)
    traceparent: str | None = None
    lora: LoRARequest | None = None  # the adapter it runs with; None: the base model


class CachedRequestData(msgspec.Struct, kw_only=True, array_like=True):
    """Diff for a request the worker already holds.

    `resumed` means the request was preempted earlier: `new_block_ids` replace its block table
    row instead of extending it.
    """

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    resumed: bool = False


# The tiers of a worker's KV cache: its device pool, a host-memory pool and a local-disk tier.
# A block is addressed by its index in the tier (block id on the device, slot below).
KV_DEVICE, KV_HOST, KV_DISK = "device", "host", "disk"

# What a worker runs (docs/disaggregation.md): every request (mixed), only the prefill of long
# prompts, whose KV then moves to a decode worker (prefill), or decodes and short prompts (decode).
ROLE_MIXED, ROLE_PREFILL, ROLE_DECODE = "mixed", "prefill", "decode"
WORKER_ROLES = (ROLE_MIXED, ROLE_PREFILL, ROLE_DECODE)


class KVCopy(msgspec.Struct, array_like=True):
    """Copy blocks between two tiers of the worker that runs the plan: device -> host (offload
    of freed prefix blocks) or host -> disk (spill of host blocks about to be overwritten).
    A plan's copies run in order, before its forward pass reads or writes any block."""

    src_tier: str
    dst_tier: str
    src: list[int]  # [n] blocks or slots of src_tier
    dst: list[int]  # [n] slots of dst_tier


class KVLoad(msgspec.Struct, kw_only=True):
    """Fill device blocks with KV kept in a lower tier, of this worker or (`remote_address`
    set) of another worker's, fetched over the KV-transfer path. Loads run alongside the plan's
    forward pass (their blocks belong to no request scheduled in it); the plan's result says
    which loads completed (`ModelRunnerOutput.kv_loads_done`) and which failed."""

    load_id: int
    block_ids: list[int]  # [n] device blocks to fill
    src_tier: str
    src: list[int]  # [n] blocks or slots of src_tier at the source
    remote_address: str = ""  # host:port of the source worker's KV-transfer server
    remote_instance_id: str = ""  # the source must be this instance (its KV is per process)


class BatchPlan(msgspec.Struct, kw_only=True):
    """One step's schedule for one worker (vLLM's SchedulerOutput)."""

    step_id: int
    new_reqs: list[NewRequestData] = []
    cached_reqs: list[CachedRequestData] = []
    num_scheduled_tokens: dict[str, int] = {}
    total_num_scheduled_tokens: int = 0
    finished_req_ids: list[str] = []
    preempted_req_ids: list[str] = []
    # The epoch of the scheduler that planned it (shared/epochs.py) and that scheduler's session
    # with this worker (new with each scheduling core of it). A plan of a new (epoch, session)
    # tells the worker to drop all request state before executing it.
    scheduler_epoch: str = ""
    worker_session: str = ""
    kv_copies: list[KVCopy] = []
    kv_loads: list[KVLoad] = []
    version: int = PROTOCOL_VERSION


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Logprobs at one position: the chosen token first, then the top alternatives.

    `rank` is the 1-based rank of the chosen token among all tokens.
    """

    token_ids: list[int]
    logprobs: list[float]
    rank: int


class ModelRunnerOutput(msgspec.Struct, kw_only=True):
    """One step's result from a worker (as vLLM's ModelRunnerOutput), plain lists only.

    `sampled_token_ids[i]` is empty for a request whose prefill chunk did not reach the end of
    its known tokens this step, else holds the one new token.
    """

    step_id: int
    worker_id: str = ""
    req_ids: list[str] = []
    sampled_token_ids: list[list[int]] = []
    logprobs: list[TokenLogprobs | None] = []
    prompt_logprobs: dict[str, list[TokenLogprobs | None]] = {}
    execute_s: float = 0.0  # the worker's time for this step (telemetry for overhead breakdown)
    # How long the worker sat idle waiting for this plan after its previous step (0 when the
    # plan was already queued): the device time the scheduler's round trip cost.
    idle_s: float = 0.0
    # The plan's KVLoads, by load_id: completed, or failed (source gone, checksum mismatch,
    # I/O error: the scheduler recomputes those blocks)
    kv_loads_done: list[int] = []
    kv_loads_failed: list[int] = []
    kv_load_bytes: int = 0  # bytes the plan's loads moved
    kv_load_s: float = 0.0  # and the time they took
    # Lower-tier slots whose content is lost (a failed disk write, a checksum mismatch), by
    # tier: the scheduler drops them from its index
    kv_lost: dict[str, list[int]] = {}
    # Requests that left the batch without running, and why (their LoRA adapter cannot run
    # here): the scheduler ends them with an error
    failed_reqs: dict[str, str] = {}
    version: int = PROTOCOL_VERSION


_encoder = msgspec.msgpack.Encoder()


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


_decoders: dict[type[Any], msgspec.msgpack.Decoder[Any]] = {}


def decoder(cls: type[M]) -> msgspec.msgpack.Decoder[M]:
    """The typed decoder of one message class, made once and reused."""
    if cls not in _decoders:
        _decoders[cls] = msgspec.msgpack.Decoder(cls)
    return cast("msgspec.msgpack.Decoder[M]", _decoders[cls])


# ---- gateway <-> scheduler ----------------------------------------------------------------


class SubmitRequest(msgspec.Struct, kw_only=True):
    """A new request (or the continuation of one after a scheduler restart).

    `output_token_ids` holds tokens already streamed to the client; they count as context and
    toward max_tokens.
    """

    req_id: str
    gateway_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    output_token_ids: list[int] = []
    priority: int = 0
    traceparent: str | None = None  # W3C trace context of the gateway's span (tracing on)
    lora_name: str | None = None  # the adapter it runs with (the scheduler knows its path)
    version: int = PROTOCOL_VERSION


class SubmitReply(msgspec.Struct, kw_only=True):
    """Accept, or reject with an HTTP-like status (400 bad request, 429 queue full, 503 not
    ready), a message meant for the API client and the request field at fault, if one is."""

    accepted: bool
    status: int = 200
    message: str = ""
    param: str | None = None
    version: int = PROTOCOL_VERSION


class LoRAAdapterChange(msgspec.Struct, kw_only=True):
    """Load (`load`, from `lora_path`) or unload the LoRA adapter `lora_name`; a gateway asks
    every scheduler shard (request-reply, `LoRAAdapterReply`)."""

    lora_name: str
    lora_path: str = ""
    load: bool = True
    version: int = PROTOCOL_VERSION


class LoRAAdapterReply(msgspec.Struct, kw_only=True):
    """Done, or refused with an HTTP-like status and the reason."""

    ok: bool
    status: int = 200
    message: str = ""
    lora_path: str = ""  # where the adapter lies, as the scheduler resolved it
    version: int = PROTOCOL_VERSION


class LoRACheck(msgspec.Struct, kw_only=True):
    """Scheduler -> worker, request-reply (`LoRAAdapterReply`): can the worker run this
    adapter (files, format, rank, shapes)? Asked before a runtime load is accepted."""

    lora: LoRARequest
    version: int = PROTOCOL_VERSION


class AbortRequests(msgspec.Struct, kw_only=True):
    req_ids: list[str]
    version: int = PROTOCOL_VERSION


class TokenDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    """New tokens of one request from one step. `finish_reason` is "stop", "length", "abort"
    or "error" on the last delta; `stop_token_id` is set when a stop token ended it, `error`
    says why the scheduler failed the request ("error")."""

    req_id: str
    new_token_ids: list[int] = []
    finish_reason: str | None = None
    stop_token_id: int | None = None
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprobs | None] = []
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    error: str | None = None


class OutputBatch(msgspec.Struct, kw_only=True):
    """Per-step deltas for the requests of one gateway, on `<prefix>.out.<gateway_id>`."""

    deltas: list[TokenDelta]
    version: int = PROTOCOL_VERSION


class CalloutHeartbeat(msgspec.Struct, kw_only=True):
    """`skiff auth-callout` is alive; the next one comes within `interval_s`."""

    interval_s: float
    version: int = PROTOCOL_VERSION


class SchedulerHeartbeat(msgspec.Struct, kw_only=True):
    """Published periodically; a new `epoch` means the scheduler restarted. `leaving` is set on
    the last one of a scheduler that shuts down: its requests move to the next scheduler."""

    epoch: str
    num_ready_workers: int
    model: str = ""
    max_model_len: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    leaving: bool = False
    # Prefix-aware shard routing: the shard's KV block size and a summary of the block hashes
    # its workers hold in any tier (shared/prefix_summary.py; empty: none)
    block_size: int = 0
    prefix_summary: bytes = b""
    lora_adapters: dict[str, str] = {}  # the LoRA adapters it serves: name -> directory
    version: int = PROTOCOL_VERSION


class GatewayHeartbeat(msgspec.Struct, kw_only=True):
    """Published periodically by each gateway to every shard: a scheduler aborts the requests
    of a gateway it no longer hears from."""

    gateway_id: str
    version: int = PROTOCOL_VERSION


# ---- operators and tests <-> scheduler ----------------------------------------------------


class SchedulerStatsRequest(msgspec.Struct, kw_only=True):
    """Asks the scheduler for a `SchedulerStats` snapshot (request-reply)."""

    version: int = PROTOCOL_VERSION


class WorkerStats(msgspec.Struct, kw_only=True):
    """One worker's load and KV blocks as its scheduling core sees them; the counters are
    cumulative. `statuses` maps each unfinished request to its status. An unhealthy worker
    missed a step deadline and gets no requests until it answers a probe."""

    num_blocks: int
    num_free_blocks: int
    num_running: int
    num_waiting: int
    num_preemptions: int
    kv_cache_usage: float
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of which found cached
    # Lower KV tiers: prompt tokens loaded from them by origin (host, disk, remote), their
    # slots and slots in use by tier, and blocks the worker reported lost (cumulative)
    kv_tier_hits: dict[str, int] = {}
    kv_tier_blocks: dict[str, int] = {}
    kv_tier_used_blocks: dict[str, int] = {}
    kv_tier_blocks_lost: int = 0
    statuses: dict[str, str] = {}
    healthy: bool = True


class SchedulerStats(msgspec.Struct, kw_only=True):
    """The scheduler's state for tests and operators: requests it holds (placed or waiting
    for a worker), each worker's stats, and the requests it aborted because their gateway went
    silent (cumulative)."""

    epoch: str
    num_requests: int
    workers: dict[str, WorkerStats] = {}
    num_orphans_aborted: int = 0
    version: int = PROTOCOL_VERSION


# ---- worker <-> scheduler -----------------------------------------------------------------


class WorkerHello(msgspec.Struct, kw_only=True):
    """A worker announcing itself (also sent as its periodic heartbeat). `step_id` is the
    step it is executing (-1: none) and `progress` its runner's units of work done since it
    started (decoder layers, logits passes), read outside the step's thread: a step whose
    worker reports progress on it is running, not hung."""

    worker_id: str
    instance_id: str  # new on every process start: a restarted worker lost its KV cache
    model: str
    block_size: int
    num_blocks: int
    max_model_len: int
    max_num_seqs: int  # rows of the worker's persistent batch: the most requests in one plan
    device: str
    vocab_size: int
    eos_token_ids: list[int] = []
    step_id: int = -1
    progress: int = 0
    # Lower KV tiers (0: off) and the size of one block in them (all layers, K and V)
    num_host_blocks: int = 0
    num_disk_blocks: int = 0
    kv_block_bytes: int = 0
    # host:port of the worker's KV-transfer server, where other workers fetch its blocks
    # ("": none)
    kv_transfer_address: str = ""
    role: str = ROLE_MIXED  # one of WORKER_ROLES
    # LoRA: adapters the worker holds at once in one batch, and their highest rank (0: off)
    max_loras: int = 0
    max_lora_rank: int = 0
    version: int = PROTOCOL_VERSION


class WorkerGoodbye(msgspec.Struct, kw_only=True):
    """A worker leaving (on SIGTERM): the scheduler moves its requests at once rather than
    after its heartbeats stop. Names the instance, so a late goodbye of an earlier instance
    cannot retire its successor."""

    worker_id: str
    instance_id: str
    version: int = PROTOCOL_VERSION
