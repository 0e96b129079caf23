"""Stand-ins for what the scheduler's parts meet on NATS: worker hellos and a publisher."""

from __future__ import annotations

from typing import Any

import msgspec

from shared.config import SchedulerConfig
from shared.wire import BatchPlan, ModelRunnerOutput, WorkerHello, encode


def make_hello(
    worker_id: str = "w0",
    *,
    instance_id: str = "i0",
    block_size: int = 16,
    num_blocks: int = 64,
    max_model_len: int = 1024,
    max_num_seqs: int = 256,
    vocab_size: int = 1000,
    max_loras: int = 0,
) -> WorkerHello:
    return WorkerHello(
        worker_id=worker_id,
        instance_id=instance_id,
        model="m",
        block_size=block_size,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        device="cpu",
        vocab_size=vocab_size,
        eos_token_ids=[2],
        max_loras=max_loras,
        max_lora_rank=16 if max_loras else 0,
    )


class FakePublisher:
    """Records what would go onto NATS, as (subject, message)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, msgspec.Struct]] = []

    async def __call__(self, subject: str, msg: msgspec.Struct) -> int:
        self.sent.append((subject, msg))
        return len(encode(msg))


class FakeWorker:
    """A worker that executes plans exactly as the real runner keeps state (persistent
    requests, its own sampled tokens fed into the next step) and samples a deterministic
    function of each request's context, so that any two correct schedules agree token for
    token. Every `eos_every`-th context value samples `eos`."""

    def __init__(self, vocab_size: int = 1000, eos: int = 2, eos_every: int = 0) -> None:
        self.vocab_size, self.eos, self.eos_every = vocab_size, eos, eos_every
        self.tokens: dict[str, list[int]] = {}  # req_id -> prompt + output tokens
        self.computed: dict[str, int] = {}
        self.min_tokens: dict[str, tuple[int, int]] = {}  # req_id -> (prompt len, min_tokens)
        self.running: set[str] = set()

    def execute(self, plan: BatchPlan) -> ModelRunnerOutput:
        for req_id in plan.finished_req_ids:
            self.tokens.pop(req_id, None)
            self.running.discard(req_id)
        self.running.difference_update(plan.preempted_req_ids)
        for new in plan.new_reqs:
            self.tokens[new.req_id] = [*new.prompt_token_ids, *new.output_token_ids]
            self.min_tokens[new.req_id] = (
                len(new.prompt_token_ids),
                new.sampling_params.min_tokens,
            )
            self.computed[new.req_id] = new.num_computed_tokens
            self.running.add(new.req_id)
        for cached in plan.cached_reqs:
            assert cached.resumed or cached.req_id in self.running, cached
            self.computed[cached.req_id] = cached.num_computed_tokens
            self.running.add(cached.req_id)
        req_ids, sampled = [], []
        for req_id, n in plan.num_scheduled_tokens.items():
            tokens = self.tokens[req_id]
            assert self.computed[req_id] + n <= len(tokens), "scheduled past the known tokens"
            self.computed[req_id] += n
            req_ids.append(req_id)
            if self.computed[req_id] < len(tokens):
                sampled.append([])
                continue
            token = self._sample(req_id, tokens)
            tokens.append(token)
            sampled.append([token])
        return ModelRunnerOutput(step_id=plan.step_id, req_ids=req_ids, sampled_token_ids=sampled)

    def _sample(self, req_id: str, tokens: list[int]) -> int:
        value = sum((i + 1) * t for i, t in enumerate(tokens)) % 9973
        num_prompt, min_tokens = self.min_tokens[req_id]
        allow_eos = len(tokens) - num_prompt >= min_tokens
        if self.eos_every and value % self.eos_every == 0 and allow_eos:
            return self.eos
        token = value % self.vocab_size
        return token if token != self.eos else token + 1


def unpaced_config(**overrides: Any) -> SchedulerConfig:
    """A scheduler config without long-prefill pacing: a served worker's core would cut a long
    prompt's first chunk to the threshold, which tests of placement and load do not measure."""
    return SchedulerConfig(long_prefill_step_time=0.0, long_prefill_share=1.0, **overrides)
