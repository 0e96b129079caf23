"""vLLM's offline interface: scheduler and worker in one process, talking in wire messages.

from services.offline import LLM, SamplingParams
llm = LLM()  # the embedded SmolLM2-135M-Instruct
out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
print(out[0].outputs[0].text)
"""

from __future__ import annotations

import itertools
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TypedDict

from services.scheduler.kv_tiers import LowerTiers
from services.scheduler.request import Request
from services.scheduler.scheduler import RequestOutput, Scheduler, plan_has_work
from services.worker.config import RunnerConfig
from services.worker.model_runner import build_runner
from shared.config import SchedulerConfig
from shared.sampling_params import (
    SamplingParams,
    SamplingParamsError,
    check_prompt_fits,
    check_token_ids,
    validate_sampling_params,
)
from shared.tokenizer import Tokenizer
from shared.wire import (
    BatchPlan,
    LoRARequest,
    ModelRunnerOutput,
    TokenLogprobs,
    decoder,
    encode,
)

__all__ = [
    "LLM",
    "CompletionOutput",
    "GenerationOutput",
    "LoRARequest",
    "PromptType",
    "SamplingParams",
    "TextPrompt",
    "TokensPrompt",
]


class TextPrompt(TypedDict):
    """vLLM's text prompt: tokenized with the model's tokenizer."""

    prompt: str


class TokensPrompt(TypedDict):
    """vLLM's prompt given as token ids."""

    prompt_token_ids: list[int]


# One prompt, in vLLM's forms (a bare list of token ids as well).
PromptType = str | list[int] | TextPrompt | TokensPrompt
_PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids"})


def _prompt_error(problem: str) -> SamplingParamsError:
    forms = "a str, a list of token ids, {'prompt': str} or {'prompt_token_ids': list[int]}"
    return SamplingParamsError(f"{problem}: a prompt is {forms}", "prompt")


def _unwrap(prompt: dict[Any, Any]) -> tuple[str, object]:
    """(key, value) of a TextPrompt or TokensPrompt dict."""
    unsupported = sorted(map(repr, prompt.keys() - _PROMPT_KEYS))
    if unsupported:
        raise _prompt_error(f"unsupported prompt key(s) {', '.join(unsupported)}")
    if len(prompt) != 1:
        raise _prompt_error(f"a prompt dict holds one key, got {sorted(prompt)}")
    ((key, value),) = prompt.items()
    return key, value


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


# LLM keywords: RunnerConfig's fields, and SchedulerConfig's that the runner does not set
# (block_size, max_num_seqs and max_model_len come from the runner).
_RUNNER_KEYS = frozenset(f.name for f in fields(RunnerConfig)) - {"model_dir"}
_SCHEDULER_KEYS = frozenset(f.name for f in fields(SchedulerConfig)) - _RUNNER_KEYS


class LLM:
    """`model`: an HF-format directory (None: the embedded SmolLM2). Keywords such as
    `num_blocks=64` or `max_num_batched_tokens=128` are fields of RunnerConfig and
    SchedulerConfig, with their defaults; `serialize_messages` sends every message through
    the wire codec."""

    def __init__(
        self, model: str | Path | None = None, *, serialize_messages: bool = False, **config: Any
    ) -> None:
        unknown = config.keys() - _RUNNER_KEYS - _SCHEDULER_KEYS
        if unknown:
            raise TypeError(f"LLM() got unexpected keyword arguments: {', '.join(sorted(unknown))}")
        if model is None:
            from services.worker.gguf_convert import ensure_default_model

            model = ensure_default_model()
        runner_config = {k: v for k, v in config.items() if k in _RUNNER_KEYS}
        self.runner = build_runner(RunnerConfig(model_dir=str(model), **runner_config))
        rc, mc = self.runner.config, self.runner.model_config
        tiers = self.runner.kv_tiers.stats
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=rc.max_num_seqs,
                max_model_len=self.runner.max_model_len,
                block_size=rc.block_size,
                max_loras=rc.max_loras if rc.enable_lora else 0,
                **{k: v for k, v in config.items() if k in _SCHEDULER_KEYS},
            ),
            self.runner.num_blocks,
            eos_token_ids=mc.eos_token_ids,
            tiers=LowerTiers(tiers.num_host_blocks, tiers.num_disk_blocks),
            kv_block_bytes=tiers.block_bytes,
        )
        self.tokenizer = Tokenizer(model)
        self.serialize_messages = serialize_messages
        self._plan_decoder = decoder(BatchPlan)
        self._output_decoder = decoder(ModelRunnerOutput)
        self._ids = itertools.count()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model-runner")
        # the runner's disk tier file goes with the engine, closed or collected
        self._close_runner = weakref.finalize(self, self.runner.close)

    def close(self) -> None:
        """Release the runner's KV tiers (its disk-tier file) and thread."""
        self._executor.shutdown()
        self._close_runner()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        priority: list[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[GenerationOutput]:
        """Run all prompts to completion together; outputs come back in prompt order.

        `prompts` is one prompt or a sequence of them; a list of ints is one prompt.
        `priority`: one per prompt, as vLLM's; with the "priority" scheduling policy, lower
        values are scheduled first (and preempted last). A prompt in another form, an invalid
        parameter, a prompt that does not fit the context, a `priority` list of another length
        or a non-zero priority under another policy raises `SamplingParamsError` (a
        ValueError) before anything is scheduled. `lora_request`: the LoRA adapter every
        prompt runs with, or one per prompt (None: the base model); the engine needs
        `enable_lora=True`.
        """
        batch: list[object]
        if isinstance(prompts, list | tuple) and not (prompts and isinstance(prompts[0], int)):
            batch = list(prompts)
        else:
            batch = [prompts]  # one prompt: a str, a dict or a list of token ids
        params = sampling_params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(batch)
        priorities = self._check_priority(priority, len(batch))
        loras = self._check_loras(lora_request, len(batch))
        checked = [self._check(prompt, p) for prompt, p in zip(batch, params_list, strict=True)]
        results: dict[str, GenerationOutput] = {}
        children: dict[str, tuple[str, int]] = {}
        for (text, token_ids), p, prio, lora in zip(
            checked, params_list, priorities, loras, strict=True
        ):
            parent = f"gen-{next(self._ids)}"
            results[parent] = GenerationOutput(parent, text, token_ids, [])
            for i in range(p.n):
                child = f"{parent}-{i}"
                children[child] = (parent, i)
                results[parent].outputs.append(CompletionOutput(i, "", []))
                self.scheduler.add_request(
                    Request(child, token_ids, p.for_choice(i), priority=prio, lora=lora)
                )
        for out in self._run():
            parent, i = children[out.req_id]
            self._accumulate(results[parent], i, out)
        for gen in results.values():
            gen.finished = True
            for completion in gen.outputs:
                completion.text = self.tokenizer.decode(completion.token_ids)
        return list(results.values())

    def _check_priority(self, priority: list[int] | None, num_prompts: int) -> list[int]:
        """Each prompt's priority (0 when not given), as the scheduling policy allows it."""
        if priority is None:
            return [0] * num_prompts
        if len(priority) != num_prompts:
            raise SamplingParamsError(
                f"The lengths of prompts ({num_prompts}) and priority ({len(priority)}) must be "
                "the same.",
                "priority",
            )
        policy = self.scheduler.config.scheduling_policy
        for value in priority:
            if value != 0 and policy != "priority":
                raise SamplingParamsError(
                    f"Got priority {value} but Priority scheduling is not enabled.", "priority"
                )
        return list(priority)

    def _check_loras(
        self, lora_request: LoRARequest | Sequence[LoRARequest | None] | None, num_prompts: int
    ) -> list[LoRARequest | None]:
        """Each prompt's adapter (None: the base model)."""
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * num_prompts
        else:
            loras = list(lora_request)
        if len(loras) != num_prompts:
            raise SamplingParamsError(
                f"The lengths of prompts ({num_prompts}) and lora_request ({len(loras)}) must "
                "be the same.",
                "lora_request",
            )
        if any(loras) and not self.scheduler.config.max_loras:
            raise SamplingParamsError("LoRA is not enabled: LLM(enable_lora=True)", "lora_request")
        for lora in {lora.lora_name: lora for lora in loras if lora is not None}.values():
            try:
                self.runner.check_lora(lora)
            except ValueError as e:  # LoRAError
                message = f"LoRA adapter {lora.lora_name}: {e}"
                raise SamplingParamsError(message, "lora_request") from None
        return loras

    def _check(self, prompt: object, params: SamplingParams) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt whose parameters are valid and that fits the context."""
        vocab_size = self.runner.model_config.vocab_size
        validate_sampling_params(params, vocab_size)
        text, token_ids = self._parse(prompt)
        check_prompt_fits(len(token_ids), self.runner.max_model_len)
        check_token_ids(token_ids, vocab_size, "prompt")
        return text, token_ids

    def _parse(self, prompt: object) -> tuple[str | None, list[int]]:
        """(text, token ids) of one prompt in any of vLLM's forms."""
        if isinstance(prompt, dict):
            key, prompt = _unwrap(prompt)
            if (key == "prompt") != isinstance(prompt, str):
                raise _prompt_error(f"{key!r} holds a {type(prompt).__name__}")
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if not isinstance(prompt, list | tuple):
            raise _prompt_error(f"got a {type(prompt).__name__}")
        not_ints = [t for t in prompt if not isinstance(t, int) or isinstance(t, bool)]
        if not_ints:
            raise SamplingParamsError(f"token ids must be ints, got {not_ints[:3]!r}", "prompt")
        return None, list(prompt)

    def _run(self) -> Iterator[RequestOutput]:
        """Step until every request finished, with the scheduler's plans in flight (two with
        async scheduling: the next plan is built while the runner's thread runs a step)."""
        sched = self.scheduler
        in_flight: deque[Future[ModelRunnerOutput]] = deque()
        while sched.has_unfinished() or in_flight:
            while len(in_flight) < sched.max_plans_in_flight and sched.has_unfinished():
                plan = sched.schedule()
                if not plan_has_work(plan):
                    break
                in_flight.append(self._executor.submit(self._execute, plan))
            if not in_flight:
                raise RuntimeError("scheduler made no progress (KV cache too small?)")
            yield from sched.update(in_flight.popleft().result())

    def _execute(self, plan: BatchPlan) -> ModelRunnerOutput:
        if self.serialize_messages:
            plan = self._plan_decoder.decode(encode(plan))
        output = self.runner.execute(plan)
        if self.serialize_messages:
            output = self._output_decoder.decode(encode(output))
        return output

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
