"""vLLM's offline interface: scheduler and worker in one process, talking in wire messages.

from services.offline import LLM, SamplingParams
llm = LLM()  # the embedded SmolLM2-135M-Instruct
out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
print(out[0].outputs[0].text)
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from services.scheduler.request import Request
from services.scheduler.scheduler import RequestOutput, Scheduler
from services.worker.model_runner import build_runner
from shared.config import SchedulerConfig
from shared.protocol import BatchPlan, ModelRunnerOutput, TokenLogprobs, decoder, encode
from shared.sampling_params import SamplingParams
from shared.tokenizer import Tokenizer

__all__ = ["LLM", "CompletionOutput", "GenerationOutput", "SamplingParams"]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | None = None
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)


@dataclass
class GenerationOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    finished: bool = False
    prompt_logprobs: list[TokenLogprobs | None] | None = None


class LLM:
    def __init__(
        self,
        model: str | Path | None = None,
        *,
        max_num_batched_tokens: int = 2048,
        max_num_seqs: int = 256,
        max_model_len: int = 2048,
        block_size: int = 16,
        kv_cache_gib: float = 1.0,
        num_blocks: int | None = None,
        enable_prefix_caching: bool = True,
        device: str = "cpu",
        dtype: str = "float32",
        serialize_messages: bool = False,
    ) -> None:
        if model is None:
            from services.worker.gguf_convert import ensure_default_model

            model = ensure_default_model()
        self.runner = build_runner(
            str(model),
            kv_cache_gib=kv_cache_gib,
            num_blocks=num_blocks,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            device=device,
            dtype=dtype,
        )
        mc = self.runner.model_config
        num_blocks = self.runner.config.num_blocks
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=max_num_batched_tokens,
                max_num_seqs=max_num_seqs,
                max_model_len=self.runner.max_model_len,
                block_size=block_size,
                enable_prefix_caching=enable_prefix_caching,
            ),
            num_blocks,
            eos_token_ids=mc.eos_token_ids,
        )
        self.tokenizer = Tokenizer(model)
        self.serialize_messages = serialize_messages
        self._plan_decoder = decoder(BatchPlan)
        self._output_decoder = decoder(ModelRunnerOutput)
        self._ids = itertools.count()

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[GenerationOutput]:
        """Run all prompts to completion together; outputs come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        results: dict[str, GenerationOutput] = {}
        children: dict[str, tuple[str, int]] = {}
        for prompt, p in zip(prompts, params_list, strict=True):
            text = prompt if isinstance(prompt, str) else None
            token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            parent = f"gen-{next(self._ids)}"
            results[parent] = GenerationOutput(parent, text, token_ids, [])
            for i in range(p.n):
                child_params = (
                    p if p.seed is None or i == 0 else msgspec.structs.replace(p, seed=p.seed + i)
                )
                child = f"{parent}-{i}"
                children[child] = (parent, i)
                results[parent].outputs.append(CompletionOutput(i, "", []))
                self.scheduler.add_request(Request(child, token_ids, child_params))
        for out in self._run():
            parent, i = children[out.req_id]
            self._accumulate(results[parent], i, out)
        for gen in results.values():
            gen.finished = True
            for completion in gen.outputs:
                completion.text = self.tokenizer.decode(completion.token_ids)
        return list(results.values())

    def _run(self):
        while self.scheduler.has_unfinished():
            plan = self.scheduler.schedule()
            if not plan.num_scheduled_tokens:
                raise RuntimeError("scheduler made no progress (KV cache too small?)")
            if self.serialize_messages:
                plan = self._plan_decoder.decode(encode(plan))
            output = self.runner.execute(plan)
            if self.serialize_messages:
                output = self._output_decoder.decode(encode(output))
            yield from self.scheduler.update(output)

    @staticmethod
    def _accumulate(gen: GenerationOutput, index: int, out: RequestOutput) -> None:
        completion = gen.outputs[index]
        completion.token_ids.extend(out.new_token_ids)
        completion.logprobs.extend(out.logprobs)
        if out.prompt_logprobs is not None and index == 0:  # a part per prefill chunk, in order
            gen.prompt_logprobs = [*(gen.prompt_logprobs or []), *out.prompt_logprobs]
        gen.num_cached_tokens = out.num_cached_tokens
        if out.finish_reason is not None:
            completion.finish_reason = out.finish_reason.value
            completion.stop_reason = out.stop_token_id
