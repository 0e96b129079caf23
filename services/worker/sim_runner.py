"""A simulated model runner (`skiff worker --device sim`): a real worker's bookkeeping and wire
behaviour without torch or weights, so a laptop or a CPU-only cluster can drive a GPU fleet.

Plans change the same persistent batch as ModelRunner's (`InputBatch`, `CachedRequestState`),
in the same order, so chunked prefill, preemption, resumption and async scheduling (a plan
that decodes the token this worker sampled one step earlier) behave as on a GPU. A sampled
token is a hash of (request key, position): the key is the request's seed when it has one (a
seeded request gives the same tokens anywhere, as with the real sampler), else its id. EOS
comes with probability `SimConfig.sim_eos_rate` per token, never before `min_tokens` outputs;
logprobs put the chosen token at rank 1; structured outputs are not enforced (its batch has
no grammar compiler: a hash follows no grammar). `step` holds the simulated device for
`SimRunner.step_time_s(plan)` on the event loop, so many simulated workers share one thread;
meanwhile `progress` counts its decoder layers as done in proportion to the time gone by. Its
lower KV tiers have the sizes its settings give, in blocks of an 8B model: a plan's KV copies
are checked and move nothing, its KV loads hold the device for their bytes at
`SimConfig.sim_kv_load_gbps` (alongside the step's own time).
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
from dataclasses import dataclass, replace
from typing import Self

import numpy as np

from services.worker.config import SIM_DEVICE, RunnerConfig, SimConfig
from services.worker.input_batch import CachedRequestState, InputBatch, apply_plan_diff
from services.worker.kv_tiers.sim_tiers import SIM_KV_BYTES_PER_TOKEN, SimKVTiers
from services.worker.lora.errors import LoRAError
from services.worker.model_config import ModelConfig
from services.worker.step_timer import StepTimer
from shared.wire import BatchPlan, LoRARequest, ModelRunnerOutput, NewRequestData, TokenLogprobs

# KV cache of one H200 serving an 8B model (SIM_KV_BYTES_PER_TOKEN: 128 KiB per token). 141 GB
# x 0.9 (vLLM's gpu_memory_utilization) is ~118 GiB; less ~15 GiB of weights and ~3 GiB of
# activations and CUDA graphs: ~100 GiB.
SIM_KV_CACHE_TOKENS = 100 * 2**30 // SIM_KV_BYTES_PER_TOKEN  # 819_200

_TOKEN, _EOS, _PROB = 1, 2, 3  # independent hash streams per (key, position)


@dataclass
class SimRequestState(CachedRequestState):
    key: int = 0  # what the request's tokens derive from (request_key)

    @classmethod
    def from_new(cls, new: NewRequestData) -> Self:
        state = super().from_new(new)
        state.key = request_key(new.req_id, new.sampling_params.seed)
        return state


def request_key(req_id: str, seed: int | None) -> int:
    """A request's 64-bit key: from its seed when it has one, else from its id."""
    text = f"req:{req_id}" if seed is None else f"seed:{seed}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, uint64 -> uint64 (multiplications wrap)."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB
    mixed: np.ndarray = x ^ (x >> 31)
    return mixed


def _draw(keys: np.ndarray, positions: np.ndarray, stream: int) -> np.ndarray:
    """[n] uint64 words from [n] keys and positions, one independent stream per purpose."""
    return _mix(keys.astype(np.uint64) ^ _mix(positions.astype(np.uint64) * 4 + stream))


def _uniform(keys: np.ndarray, positions: np.ndarray, stream: int) -> np.ndarray:
    """[n] floats in [0, 1)."""
    return (_draw(keys, positions, stream) >> 11).astype(np.float64) * 2.0**-53


def sample_tokens(
    keys: np.ndarray,
    positions: np.ndarray,
    eos_allowed: np.ndarray,
    info: ModelConfig,
    eos_rate: float,
) -> np.ndarray:
    """[n] tokens sampled at `positions` (each token's index in its sequence) of requests with
    `keys`: EOS with probability `eos_rate` where `eos_allowed`, else a hash that avoids EOS."""
    tokens = (_draw(keys, positions, _TOKEN) % info.vocab_size).astype(np.int64)
    eos = np.asarray(info.eos_token_ids, dtype=np.int64)
    for _ in eos:  # step past EOS ids (at most one step per id)
        hit = np.isin(tokens, eos)
        tokens[hit] = (tokens[hit] + 1) % info.vocab_size
    if eos.size and eos_rate > 0:
        tokens[eos_allowed & (_uniform(keys, positions, _EOS) < eos_rate)] = eos[0]
    return tokens


def token_logprobs(token: int, key: int, position: int, k: int, vocab_size: int) -> TokenLogprobs:
    """`token` at rank 1 with a probability in [0.35, 0.95) from (key, position), then the top k
    as ModelRunner sends them: itself, then tokens with half the rest, a quarter, ..."""
    p = 0.35 + 0.6 * float(_uniform(np.array([key], np.uint64), np.array([position]), _PROB)[0])
    others = [((token + j) % vocab_size, (1 - p) / 2**j) for j in range(1, k)]
    entries = [(token, p), *[(token, p), *others][:k]]  # [1 + k]
    return TokenLogprobs([t for t, _ in entries], [math.log(q) for _, q in entries], 1)


def prompt_entry_range(num_prompt: int, start: int, num_scheduled: int, sent: int) -> range:
    """sampler/prompt_logprobs.entry_range (that module imports torch): the prompt logprob
    entries to send after computing positions [start, start + num_scheduled)."""
    return range(sent, min(start + num_scheduled, num_prompt - 1) + 1)


class SimRunner:
    """ModelRunner's surface for WorkerService, with a simulated device."""

    def __init__(
        self, config: RunnerConfig, sim: SimConfig, model_config: ModelConfig | None = None
    ) -> None:
        """`config.num_blocks` None: an H200's KV cache for an 8B model (SIM_KV_CACHE_TOKENS);
        `model_config`: the model dir's, when the caller has read it already."""
        self.num_blocks = config.num_blocks or SIM_KV_CACHE_TOKENS // config.block_size
        self.config = replace(config, num_blocks=self.num_blocks)
        self.sim = sim
        self.device = SIM_DEVICE
        self.model_config = model_config or ModelConfig.from_dir(config.model_dir)
        self.max_model_len = min(config.max_model_len, self.model_config.max_position_embeddings)
        self.timer = StepTimer()  # forward: the time it holds the simulated device
        self._layers_done = 0  # of the steps held to the end
        self._holding: tuple[float, float] | None = None  # monotonic span of the step held
        c = self.config
        self.kv_tiers = SimKVTiers(
            self.num_blocks,
            c.block_size,
            c.kv_offloading_size,
            c.kv_offloading_disk_size,
            sim.sim_kv_load_gbps,
        )
        self.reset()

    def check_lora(self, lora: LoRARequest) -> None:
        """A simulated worker runs any adapter its slots allow (it reads no weights)."""
        if not self.config.enable_lora:
            raise LoRAError("this worker runs without --enable-lora")

    def reset(self) -> None:
        """Forget every request (the scheduler that placed them is gone)."""
        self.requests: dict[str, SimRequestState] = {}
        self.batch = InputBatch(
            self.config.max_num_seqs, self.max_model_len, self.config.block_size
        )

    def close(self) -> None:
        """Nothing to release."""

    def step_time_s(self, plan: BatchPlan) -> float:
        """How long the plan holds the simulated device."""
        tokens = plan.num_scheduled_tokens
        return self.sim.step_time_s(sum(tokens.values()), len(tokens))

    @property
    def progress(self) -> int:
        """Decoder layers run so far, as ModelRunner's: every layer of each step held to the
        end, and of the step holding the device the share of its time gone by."""
        if self._holding is None:
            return self._layers_done
        start, end = self._holding
        share = min(1.0, (time.monotonic() - start) / (end - start)) if end > start else 1.0
        return self._layers_done + int(self.model_config.num_hidden_layers * share)

    async def step(self, plan: BatchPlan) -> ModelRunnerOutput:
        """Execute the plan, then hold the device until its modelled time, and that of its
        KV loads (which run alongside), has passed; other coroutines (heartbeats, other
        simulated workers) run meanwhile."""
        loop = asyncio.get_running_loop()
        step_s = self.step_time_s(plan)
        started_at = loop.time()
        if plan.num_scheduled_tokens:
            started = time.monotonic()
            self._holding = (started, started + step_s)
        try:
            output = self.execute(plan)
            held_from = loop.time()
            done_at = started_at + max(step_s, output.kv_load_s)
            await asyncio.sleep(max(0.0, done_at - held_from))
        finally:
            if self._holding is not None:
                self._holding = None
                self._layers_done += self.model_config.num_hidden_layers
        if plan.num_scheduled_tokens:
            self.timer.add("forward", loop.time() - held_from)
        return output

    # ---- the step, as ModelRunner.execute without the model ---------------------------------

    def execute(self, plan: BatchPlan) -> ModelRunnerOutput:
        self.timer.begin()
        apply_plan_diff(self.batch, self.requests, plan, SimRequestState)
        self.kv_tiers.copy(plan.kv_copies)
        output = self._run_model(plan)
        self.kv_tiers.load(plan.kv_loads, output)
        return output

    def _run_model(self, plan: BatchPlan) -> ModelRunnerOutput:
        if not plan.num_scheduled_tokens:
            return ModelRunnerOutput(step_id=plan.step_id)
        batch = self.batch
        req_ids = list(plan.num_scheduled_tokens)
        rows = np.fromiter((batch.req_id_to_index[r] for r in req_ids), np.int64, len(req_ids))
        num_sched = np.fromiter(plan.num_scheduled_tokens.values(), np.int64, len(req_ids))
        seq_lens = batch.num_computed_tokens[rows] + num_sched  # [num_reqs]
        self._check(req_ids, rows, seq_lens)
        sampling = seq_lens >= batch.num_tokens[rows]  # [num_reqs] reached its known tokens
        batch.num_computed_tokens[rows] = seq_lens
        prompt_logprobs = self._prompt_logprobs(req_ids, rows, num_sched)
        self.timer.mark("prepare")
        output = self._write_back(plan.step_id, req_ids, rows, sampling)
        output.prompt_logprobs = prompt_logprobs
        self.timer.mark("write_back")
        return output

    def _check(self, req_ids: list[str], rows: np.ndarray, seq_lens: np.ndarray) -> None:
        """What ModelRunner would compute on garbage: tokens it does not know, or KV slots
        without a block."""
        batch, bs = self.batch, self.config.block_size
        bad = (seq_lens > batch.num_tokens[rows]) | (seq_lens > batch.num_blocks[rows] * bs)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(
                f"{req_ids[i]}: scheduled up to {seq_lens[i]} tokens; it has "
                f"{batch.num_tokens[rows[i]]} tokens and {batch.num_blocks[rows[i]]} blocks"
            )

    def _write_back(
        self, step_id: int, req_ids: list[str], rows: np.ndarray, sampling: np.ndarray
    ) -> ModelRunnerOutput:
        batch = self.batch
        idx = np.flatnonzero(sampling)  # [num_sampling] query order
        states = [self.requests[req_ids[i]] for i in idx.tolist()]
        sampling_rows = rows[idx]
        positions = batch.num_tokens[sampling_rows]  # where each sampled token goes
        keys = np.fromiter((s.key for s in states), np.uint64, len(states))
        num_out = np.fromiter((len(s.output_token_ids) for s in states), np.int64, len(states))
        eos_allowed = num_out >= batch.sampling.min_tokens[sampling_rows]
        sampled = sample_tokens(
            keys, positions, eos_allowed, self.model_config, self.sim.sim_eos_rate
        )
        self.timer.mark("sample")
        batch.append_tokens(sampling_rows, sampled)
        per_req: list[list[int]] = [[] for _ in req_ids]
        logprobs: list[TokenLogprobs | None] = [None] * len(req_ids)
        wanted = batch.sampling.num_logprobs[sampling_rows].tolist()
        vocab = self.model_config.vocab_size
        for i, state, token, pos, k in zip(
            idx.tolist(), states, sampled.tolist(), positions.tolist(), wanted, strict=True
        ):
            state.output_token_ids.append(token)
            per_req[i] = [token]
            if k >= 0:
                logprobs[i] = token_logprobs(token, state.key, pos, k, vocab)
        return ModelRunnerOutput(
            step_id=step_id,
            req_ids=req_ids,
            sampled_token_ids=per_req,
            logprobs=logprobs if max(wanted, default=-1) >= 0 else [],
        )

    def _prompt_logprobs(
        self, req_ids: list[str], rows: np.ndarray, num_sched: np.ndarray
    ) -> dict[str, list[TokenLogprobs | None]]:
        """This step's part of each asking request's prompt logprobs, as ModelRunner's."""
        out: dict[str, list[TokenLogprobs | None]] = {}
        vocab = self.model_config.vocab_size
        for i in np.flatnonzero(self.batch.sampling.num_prompt_logprobs[rows] >= 0).tolist():
            state = self.requests[req_ids[i]]
            if state.output_token_ids:  # prompt done (here or on the worker it came from)
                continue
            start, prompt = state.num_computed_tokens, state.prompt_token_ids  # start: pre-step
            entries = prompt_entry_range(
                len(prompt), start, int(num_sched[i]), state.num_prompt_logprobs_sent
            )
            if not entries:
                continue
            computed = range(max(entries.start, start + 1), entries.stop)
            k = int(self.batch.sampling.num_prompt_logprobs[rows[i]])
            values = [token_logprobs(prompt[q], state.key, q, k, vocab) for q in computed]
            out[state.req_id] = [None] * (len(entries) - len(computed)) + values
            state.num_prompt_logprobs_sent = entries.stop
        return out
