"""Model runner: applies each BatchPlan's diff to the persistent batch, prepares the step's
tensors, runs the model and the sampler, and writes sampled tokens back.

Structured outputs: the step's grammar masks are filled on the CPU right after the forward is
launched, so on CUDA they are ready while the GPU still runs it; on the CPU they add to the
step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import msgspec
import numpy as np
import torch

from kernels import cpu_ops
from kernels.lora_mapping import NO_LORA, LoRAMapping
from services.worker.attention import AttentionMetadata, get_attention_backend
from services.worker.config import RunnerConfig
from services.worker.cpu_decode import FusedCpuDecode
from services.worker.cuda_graphs import DecodeGraphs
from services.worker.grammar import GrammarCompiler
from services.worker.grammar_bitmask import GrammarBitmask
from services.worker.input_batch import CachedRequestState, InputBatch, apply_plan_diff
from services.worker.kv_tiers.setup import build_kv_tiers
from services.worker.loader import load_model
from services.worker.lora.errors import LoRAError
from services.worker.lora.manager import LoRAManager
from services.worker.model_config import ModelConfig
from services.worker.models.decoder import DecoderForCausalLM
from services.worker.sampler import Sampler, SamplerOutput, SamplingMetadata
from services.worker.sampler import prompt_logprobs as prompt_lp
from services.worker.sampler.metadata import GrammarMask
from services.worker.sampling_metadata import build_sampling_metadata
from services.worker.step_timer import StepTimer
from services.worker.weight_format import convert_weights, pack_panels
from shared.arith import cdiv
from shared.wire import BatchPlan, LoRARequest, ModelRunnerOutput, TokenLogprobs

log = logging.getLogger("skiff.worker")


@dataclass
class StepInputs:
    req_ids: list[str]  # scheduled requests, in query order
    rows: np.ndarray  # [num_reqs] their batch rows
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [num_sampling] query row of each sampling request's last token
    sampling: np.ndarray  # [num_reqs] bool: request reached the end of its known tokens
    lora: LoRAMapping | None = None  # each token's adapter slot; None: no token has one


# A request's prompt logprobs in one step: (its state, its number of top alternatives, the
# entries to send, how many of them this step computed, their first row among the step's)
_PromptSpan = tuple[CachedRequestState, int, range, int, int]


def _load_weights(
    config: RunnerConfig,
    mc: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    max_positions: int,
) -> DecoderForCausalLM:
    """The checkpoint, its projections in the CPU weight format `config` names and, on the
    CPU with the C++ ops, packed in panels."""
    model = load_model(
        config.model_dir, mc, get_attention_backend(device), device, dtype, max_positions
    )
    if config.cpu_weights != "fp32":
        if not cpu_ops.load():
            raise RuntimeError(f"--cpu-weights {config.cpu_weights} needs the C++ CPU ops")
        convert_weights(model, config.cpu_weights)
    if device.type == "cpu" and cpu_ops.load():
        pack_panels(model, config.cpu_weights)
    return model


class ModelRunner:
    def __init__(
        self,
        config: RunnerConfig,
        model_config: ModelConfig | None = None,
        *,
        worker_id: str = "worker",
    ) -> None:
        """`config.num_blocks` must be set (`build_runner` sizes it from kv_cache_gib);
        `model_config`: the model dir's, when the caller has read it already; `worker_id`
        names the disk tier's file."""
        if config.num_blocks is None:
            raise ValueError("RunnerConfig.num_blocks is None: use build_runner(config)")
        self.config = config
        self.num_blocks: int = config.num_blocks
        self.device = torch.device(config.device)
        mc = self.model_config = model_config or ModelConfig.from_dir(config.model_dir)
        self.max_model_len = min(config.max_model_len, mc.max_position_embeddings)
        dtype = getattr(torch, config.dtype)
        self.model = _load_weights(config, mc, self.device, dtype, self.max_model_len)
        self.lora = self._lora_manager(dtype)
        # One tensor per layer: [2, num_blocks, block_size, num_kv_heads, head_dim]
        shape = (2, self.num_blocks, config.block_size, mc.num_key_value_heads, mc.head_dim)
        self.kv_caches = [
            torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(mc.num_hidden_layers)
        ]
        self.kv_tiers = build_kv_tiers(self.kv_caches, config, worker_id)
        self.grammar = GrammarCompiler(config.model_dir, mc.vocab_size, mc.eos_token_ids)
        self.grammar_bitmask = GrammarBitmask(config.max_num_seqs, mc.vocab_size, self.device)
        self.batch = self._new_batch()
        self.requests: dict[str, CachedRequestState] = {}
        self._failed_req_ids: set[str] = set()  # failed here, still in plans sent before
        self._step_slots: dict[str, int] = {}  # the step's adapters -> their slot
        self.sampler = Sampler()
        self.timer = StepTimer(cuda=self.device.type == "cuda")
        self.num_tokens_computed = 0  # all tokens run through the model so far
        self.decode_graphs: DecodeGraphs | None = None
        if self.device.type == "cuda" and config.cuda_graphs:
            self.decode_graphs = DecodeGraphs(
                self.model,
                self.kv_caches,
                config.max_num_seqs,
                cdiv(self.max_model_len, config.block_size),
                self.max_model_len,
                self.device,
            )
            self.decode_graphs.capture()
        self.fused_cpu_decode: FusedCpuDecode | None = None
        cpu = self.device.type == "cpu"
        if cpu and config.fused_cpu_decode and FusedCpuDecode.supports(self.model):
            self.fused_cpu_decode = FusedCpuDecode(self.model, self.kv_caches)

    def _lora_manager(self, dtype: torch.dtype) -> LoRAManager | None:
        """The adapter slots, with --enable-lora."""
        c = self.config
        if not c.enable_lora:
            return None
        return LoRAManager(
            self.model,
            self.model_config,
            c.model_dir,
            c.max_loras,
            c.max_lora_rank,
            self.device,
            dtype,
        )

    def reset(self) -> None:
        """Forget every request (the scheduler that placed them is gone)."""
        self.requests.clear()
        self._failed_req_ids.clear()
        self.batch = self._new_batch()

    def close(self) -> None:
        """Release the KV tiers (the disk tier's file is deleted)."""
        self.kv_tiers.close()

    @property
    def progress(self) -> int:
        """The model's decoder layers and logits passes since load (heartbeats report it)."""
        return self.model.progress

    def _new_batch(self) -> InputBatch:
        c = self.config
        return InputBatch(c.max_num_seqs, self.max_model_len, c.block_size, self.grammar)

    # ---- the step ----------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, plan: BatchPlan) -> ModelRunnerOutput:
        """The plan's KV copies, then its forward pass while its KV loads run. A request
        whose LoRA adapter cannot run here leaves the step and the batch, named in the
        output's `failed_reqs` with the reason; the others run."""
        self.timer.begin()
        plan = self._without_failed(plan)
        self._update_states(plan)
        failed = self._drop_unrunnable_loras(plan)
        if failed:
            scheduled = {r: n for r, n in plan.num_scheduled_tokens.items() if r not in failed}
            plan = msgspec.structs.replace(
                plan,
                num_scheduled_tokens=scheduled,
                total_num_scheduled_tokens=sum(scheduled.values()),
            )
        loads = self.kv_tiers.begin(plan.kv_copies, plan.kv_loads)
        try:
            output = self._run_model(plan)
        finally:
            report = loads.wait()
        self.kv_tiers.report(report, output)
        output.failed_reqs = failed
        return output

    def _run_model(self, plan: BatchPlan) -> ModelRunnerOutput:
        if not plan.num_scheduled_tokens:
            return ModelRunnerOutput(step_id=plan.step_id)
        inputs = self._prepare_inputs(plan)
        sampling_rows = inputs.rows[inputs.sampling]
        # On the CPU the forward streams every weight through the caches, evicting the host's
        # own state: the sampling metadata is built before it, while that state is warm
        # (~4x cheaper at a single-stream step). On CUDA it is built while the forward runs.
        meta = None if self.device.type == "cuda" else self._sampling_metadata(sampling_rows)
        self.timer.mark("prepare")
        self.num_tokens_computed += len(inputs.positions)
        hidden = self._forward(inputs)  # [num_tokens, hidden_size]
        if meta is None:
            meta = self._sampling_metadata(sampling_rows)
        prompt_logprobs = self._prompt_logprobs(plan, inputs, hidden)  # extra logits rows
        logits = self.model.compute_logits(hidden[inputs.logits_indices])  # [num_sampling, vocab]
        self.timer.mark("forward")
        result = self.sampler(logits, meta)
        self.timer.mark("sample")
        output = self._write_back(plan.step_id, inputs, sampling_rows, result)
        output.prompt_logprobs = prompt_logprobs
        self.timer.mark("write_back")
        return output

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        self.timer.cuda_graph = False
        fused = self.fused_cpu_decode
        decode_only = inputs.meta.max_query_len == 1
        if inputs.lora is not None and self.lora is not None:
            if fused is not None and decode_only and fused.runs_lora:
                return fused.forward(inputs.input_ids, inputs.positions, inputs.meta, inputs.lora)
            # eager: the captured graphs do not carry adapters
            with self.lora.step.use(inputs.lora):
                return self._eager_forward(inputs)
        if self.decode_graphs is not None:
            hidden = self.decode_graphs.run(inputs.input_ids, inputs.positions, inputs.meta)
            if hidden is not None:
                self.timer.cuda_graph = True
                return hidden
        if fused is not None and decode_only:
            return fused.forward(inputs.input_ids, inputs.positions, inputs.meta)
        return self._eager_forward(inputs)

    def _eager_forward(self, inputs: StepInputs) -> torch.Tensor:
        out: torch.Tensor = self.model(
            inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta
        )
        return out

    def _update_states(self, plan: BatchPlan) -> None:
        apply_plan_diff(self.batch, self.requests, plan, CachedRequestState)

    def check_lora(self, lora: LoRARequest) -> None:
        """Raise `LoRAError` unless `lora` would load here (nothing is loaded)."""
        if self.lora is None:
            raise LoRAError("this worker runs without --enable-lora")
        self.lora.check(lora)

    def _without_failed(self, plan: BatchPlan) -> BatchPlan:
        """`plan` without the requests failed here before its scheduler heard of it."""
        if not self._failed_req_ids:
            return plan
        self._failed_req_ids.difference_update(plan.finished_req_ids)
        gone = self._failed_req_ids
        scheduled = {r: n for r, n in plan.num_scheduled_tokens.items() if r not in gone}
        return msgspec.structs.replace(
            plan,
            cached_reqs=[c for c in plan.cached_reqs if c.req_id not in gone],
            num_scheduled_tokens=scheduled,
            total_num_scheduled_tokens=sum(scheduled.values()),
        )

    def _drop_unrunnable_loras(self, plan: BatchPlan) -> dict[str, str]:
        """Give each adapter of the step's requests a slot, loading those not held; the
        requests whose adapter cannot have one (LoRA off, a checkpoint that fails to load,
        more adapters than slots) leave the batch. Returns their reasons by request id."""
        failed: dict[str, str] = {}
        held = self._step_slots = {}  # adapters of this step -> their slot
        for req_id in plan.num_scheduled_tokens:
            lora = self.requests[req_id].lora
            if lora is None or lora.lora_name in held:
                continue
            try:
                if self.lora is None:
                    raise LoRAError("this worker runs without --enable-lora")
                held[lora.lora_name] = self.lora.ensure_loaded(lora, held)
            except LoRAError as e:
                failed[req_id] = f"LoRA adapter {lora.lora_name}: {e}"
        for req_id, reason in failed.items():
            log.warning("request %s failed: %s", req_id, reason)
            self.requests.pop(req_id)
            self.batch.remove_request(req_id)
            self._failed_req_ids.add(req_id)
        return failed

    def _prepare_inputs(self, plan: BatchPlan) -> StepInputs:
        batch, bs = self.batch, self.config.block_size
        req_ids = list(plan.num_scheduled_tokens)
        rows = np.fromiter((batch.req_id_to_index[r] for r in req_ids), np.int64, len(req_ids))
        num_sched = np.fromiter(plan.num_scheduled_tokens.values(), np.int64, len(req_ids))
        query_start_loc = np.zeros(len(req_ids) + 1, dtype=np.int64)
        np.cumsum(num_sched, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        token_req = np.repeat(np.arange(len(req_ids)), num_sched)  # [num_tokens]
        token_rows = rows[token_req]
        lora = self._lora_mapping(req_ids, token_req)
        positions = (
            batch.num_computed_tokens[token_rows]
            + np.arange(num_tokens)
            - query_start_loc[token_req]
        )
        input_ids = batch.token_ids[token_rows, positions]
        slot_mapping = batch.block_table[token_rows, positions // bs] * bs + positions % bs
        seq_lens = batch.num_computed_tokens[rows] + num_sched
        max_blocks = int(batch.num_blocks[rows].max())
        sampling = seq_lens >= batch.num_tokens[rows]
        dev = self.device
        meta = AttentionMetadata(
            query_start_loc=torch.from_numpy(query_start_loc).to(dev, torch.int32),
            seq_lens=torch.from_numpy(seq_lens).to(dev, torch.int32),
            block_table=torch.from_numpy(batch.block_table[rows, :max_blocks]).to(dev, torch.int32),
            slot_mapping=torch.from_numpy(slot_mapping).to(dev),
            max_query_len=int(num_sched.max()),
            max_seq_len=int(seq_lens.max()),
            query_lens_cpu=num_sched.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
        )
        batch.num_computed_tokens[rows] = seq_lens
        return StepInputs(
            req_ids=req_ids,
            rows=rows,
            input_ids=torch.from_numpy(input_ids).to(dev),
            positions=torch.from_numpy(positions).to(dev),
            meta=meta,
            logits_indices=torch.from_numpy(query_start_loc[1:][sampling] - 1).to(dev),
            sampling=sampling,
            lora=lora,
        )

    def _lora_mapping(self, req_ids: list[str], token_req: np.ndarray) -> LoRAMapping | None:
        """Each scheduled token's adapter slot (`token_req` [num_tokens]: its request's index
        in `req_ids`), as `_drop_unrunnable_loras` gave them; None when no request has one."""
        if not self._step_slots:
            return None
        slots = [self._step_slots.get(lora.lora_name, NO_LORA) if lora else NO_LORA
                 for lora in (self.requests[r].lora for r in req_ids)]  # fmt: skip
        token_lora_indices = np.asarray(slots, dtype=np.int64)[token_req]  # [num_tokens]
        return LoRAMapping.build(torch.from_numpy(token_lora_indices).to(self.device))

    def _grammar_mask(self, rows: np.ndarray) -> GrammarMask | None:
        """The next-token masks of the sampled rows that follow a grammar."""
        sel, matchers = self.batch.structured(rows)
        if not matchers:
            return None
        bitmask = self.grammar_bitmask.fill(matchers)
        return GrammarMask(torch.from_numpy(sel).to(self.device), bitmask)

    def _sampling_metadata(self, rows: np.ndarray) -> SamplingMetadata:
        """The sampling metadata of the sampled `rows`, their grammar masks included."""
        mc = self.model_config
        return build_sampling_metadata(
            self.batch,
            rows,
            mc.vocab_size,
            mc.eos_token_ids,
            self.device,
            grammar=self._grammar_mask(rows),
        )

    def _write_back(
        self, step_id: int, inputs: StepInputs, sampling_rows: np.ndarray, result: SamplerOutput
    ) -> ModelRunnerOutput:
        sampled = result.sampled_token_ids.cpu().numpy()  # [num_sampling]
        self.timer.synced()  # that copy waited for the step's device work
        self.batch.append_tokens(sampling_rows, sampled)
        per_req: list[list[int]] = [[] for _ in inputs.req_ids]
        logprobs: list[TokenLogprobs | None] = [None] * len(inputs.req_ids)
        lp_rows = self._logprobs_lists(result, sampling_rows)
        for j, i in enumerate(np.flatnonzero(inputs.sampling).tolist()):
            token = int(sampled[j])
            self.requests[inputs.req_ids[i]].output_token_ids.append(token)
            per_req[i] = [token]
            logprobs[i] = lp_rows[j]
        return ModelRunnerOutput(
            step_id=step_id,
            req_ids=inputs.req_ids,
            sampled_token_ids=per_req,
            logprobs=logprobs if result.logprobs is not None else [],
        )

    def _logprobs_lists(
        self, result: SamplerOutput, rows: np.ndarray
    ) -> list[TokenLogprobs | None]:
        top_ids, top_values, ranks_t = (
            result.logprob_token_ids,
            result.logprobs,
            result.sampled_ranks,
        )
        if top_ids is None or top_values is None or ranks_t is None:
            return [None] * len(rows)
        ids, values, ranks = top_ids.tolist(), top_values.tolist(), ranks_t.tolist()
        wanted = self.batch.sampling.num_logprobs[rows].tolist()
        return [
            TokenLogprobs(ids[j][: k + 1], values[j][: k + 1], ranks[j]) if k >= 0 else None
            for j, k in enumerate(wanted)
        ]

    # ---- prompt logprobs (extra logits rows for requests that ask) --------------------------

    def _prompt_logprobs(
        self, plan: BatchPlan, inputs: StepInputs, hidden: torch.Tensor
    ) -> dict[str, list[TokenLogprobs | None]]:
        """This step's part of each asking request's prompt logprobs (see
        sampler/prompt_logprobs.py: parts arrive in order, the consumer concatenates them).

        Loops only over the requests that asked; positions are batched into one computation.
        """
        wanted = np.flatnonzero(self.batch.sampling.num_prompt_logprobs[inputs.rows] >= 0)
        if not wanted.size:
            return {}
        num_sched = [plan.num_scheduled_tokens[r] for r in inputs.req_ids]
        query_start = np.cumsum([0, *num_sched])
        spans: list[_PromptSpan] = []
        hidden_rows: list[int] = []
        targets: list[int] = []
        num_top = self.batch.sampling.num_prompt_logprobs[inputs.rows].tolist()
        for i in wanted.tolist():
            state = self.requests[inputs.req_ids[i]]
            if state.output_token_ids:  # prompt done (here or on the worker it came from)
                continue
            start, prompt = state.num_computed_tokens, state.prompt_token_ids  # start: pre-step
            entries = prompt_lp.entry_range(
                len(prompt), start, num_sched[i], state.num_prompt_logprobs_sent
            )
            if not entries:
                continue
            computed = range(max(entries.start, start + 1), entries.stop)
            spans.append((state, num_top[i], entries, len(computed), len(hidden_rows)))
            hidden_rows.extend(query_start[i] + q - 1 - start for q in computed)
            targets.extend(prompt[q] for q in computed)
        return self._prompt_logprobs_lists(spans, hidden, hidden_rows, targets)

    def _prompt_logprobs_lists(
        self,
        spans: list[_PromptSpan],
        hidden: torch.Tensor,
        hidden_rows: list[int],
        targets: list[int],
    ) -> dict[str, list[TokenLogprobs | None]]:
        top = None
        if hidden_rows:
            num_top = max(span[1] for span in spans)
            rows, tgt = np.asarray(hidden_rows, np.int64), np.asarray(targets, np.int64)
            top = prompt_lp.compute(self.model.compute_logits, hidden, rows, tgt, num_top)
        out: dict[str, list[TokenLogprobs | None]] = {}
        for state, k, entries, num_computed, lo in spans:
            values: list[TokenLogprobs] = []
            if top is not None and num_computed:
                values = prompt_lp.to_lists(top, lo, lo + num_computed, k)
            out[state.req_id] = [None] * (len(entries) - num_computed) + values
            state.num_prompt_logprobs_sent = entries.stop
        return out


def num_kv_blocks(mc: ModelConfig, block_size: int, gib: float, dtype: str) -> int:
    """How many KV blocks of all layers fit in `gib` GiB."""
    dtype_bytes = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    per_block = 2 * mc.num_hidden_layers * block_size * mc.num_key_value_heads * mc.head_dim
    return max(1, int(gib * 2**30) // (per_block * dtype_bytes))


def build_runner(config: RunnerConfig, worker_id: str = "worker") -> ModelRunner:
    """A runner whose KV cache has `config.num_blocks` blocks or, when that is None, as many
    as fit in `config.kv_cache_gib`; its `config` carries the resolved num_blocks."""
    mc = ModelConfig.from_dir(config.model_dir)
    if config.num_blocks is None:
        blocks = num_kv_blocks(mc, config.block_size, config.kv_cache_gib, config.dtype)
        config = replace(config, num_blocks=blocks)
    return ModelRunner(config, mc, worker_id=worker_id)
