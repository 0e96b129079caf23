"""POST /v1/completions: prompts as text or token ids, n choices each, echo, logprobs,
structured outputs."""

from __future__ import annotations

import time
from dataclasses import dataclass

from fastapi import APIRouter, Request
from starlette.responses import Response

from services.gateway.choice import ChoiceSpec, ChoiceUpdate
from services.gateway.context import GatewayContext
from services.gateway.detokenizer import IncrementalDetokenizer
from services.gateway.errors import APIError
from services.gateway.generation import Generation
from services.gateway.logprobs import completion_logprobs, prompt_logprobs_body
from services.gateway.sampling import build_sampling_params, check_sizes, stop_strings
from services.gateway.schemas import CompletionRequest
from services.gateway.serving import (
    Payload,
    check_num_choices,
    engine_base_id,
    event_stream,
    request_id,
    respond_once,
    usage,
)
from services.gateway.sse import EventStreamResponse
from services.gateway.structured import requested_structure
from shared.sampling_params import check_prompt_fits, check_token_ids, resolve_max_tokens


@dataclass
class Prompt:
    text: str  # what echo returns
    token_ids: list[int]


async def _prompts(ctx: GatewayContext, body: CompletionRequest) -> list[Prompt]:
    """The prompts, each bounded by the context length before it is tokenized or decoded."""
    raw = body.prompt
    if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
        raw = [raw]  # type: ignore[list-item]
    if not raw:
        raise APIError(400, "prompt must not be empty", "prompt")
    check_num_choices(len(raw), body.n)
    prompts = []
    for item in raw:
        if isinstance(item, str):
            prompts.append(Prompt(item, await ctx.encode(item, body.add_special_tokens, "prompt")))
        else:
            check_prompt_fits(len(item), ctx.max_model_len())
            check_token_ids(item, ctx.tokenizer.vocab_size, "prompt")
            prompts.append(Prompt(ctx.tokenizer.decode(item, skip_special_tokens=False), item))
    return prompts


class _Formatter:
    """Turns choice updates into completion choices (echo and logprobs included)."""

    def __init__(
        self, ctx: GatewayContext, body: CompletionRequest, prompts: list[Prompt], gen: Generation
    ) -> None:
        self.ctx, self.body, self.prompts, self.gen = ctx, body, prompts, gen
        self.started: set[int] = set()

    def prompt_of(self, index: int) -> Prompt:
        return self.prompts[index // self.body.n]

    def choice(self, update: ChoiceUpdate) -> Payload:
        prompt = self.prompt_of(update.index)
        first = update.index not in self.started
        self.started.add(update.index)
        echo = self.body.echo and first
        state = self.gen.choices[update.index]
        show_prompt_logprobs = first and self.body.prompt_logprobs is not None
        return {
            "index": update.index,
            "text": (prompt.text if echo else "") + update.text,
            "logprobs": self._logprobs(update, prompt, echo),
            "finish_reason": update.finish_reason,
            "stop_reason": update.stop_reason,
            "prompt_logprobs": prompt_logprobs_body(
                self.ctx.tokenizer, prompt.token_ids, state.prompt_logprobs
            )
            if show_prompt_logprobs
            else None,
        }

    def _logprobs(self, update: ChoiceUpdate, prompt: Prompt, echo: bool) -> Payload | None:
        num_top = self.body.logprobs
        if num_top is None:
            return None
        tokens, logprobs = update.token_ids, update.logprobs
        offsets = (
            [len(prompt.text) + o for o in update.text_offsets]
            if self.body.echo
            else update.text_offsets
        )
        if echo:
            prompt_lps = self.gen.choices[update.index].prompt_logprobs
            tokens = prompt.token_ids + tokens
            logprobs = list(prompt_lps or [None] * len(prompt.token_ids)) + logprobs
            offsets = self._prompt_offsets(prompt) + offsets
        return completion_logprobs(self.ctx.tokenizer, tokens, logprobs, offsets, num_top)

    def _prompt_offsets(self, prompt: Prompt) -> list[int]:
        detok = IncrementalDetokenizer(self.ctx.tokenizer, [], skip_special_tokens=False)
        offsets, position = [], 0
        for token_id in prompt.token_ids:
            offsets.append(position)
            position += len(detok.step(token_id))
        return offsets


def router(ctx: GatewayContext) -> APIRouter:
    api = APIRouter()

    @api.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        ctx.check_accepting()
        ctx.check_model(body.model)
        if body.suffix:
            raise APIError(400, "suffix is not currently supported", "suffix")
        max_model_len = ctx.max_model_len()
        check_sizes(body, ctx.encoder)
        structure = requested_structure(body)
        if structure is not None:
            await ctx.structures.check(structure)
        prompts = await _prompts(ctx, body)
        prompt_logprobs = body.prompt_logprobs
        if body.echo and body.logprobs is not None and prompt_logprobs is None:
            prompt_logprobs = body.logprobs
        base, specs = engine_base_id(), []
        for p, prompt in enumerate(prompts):
            max_tokens = resolve_max_tokens(body.max_tokens, len(prompt.token_ids), max_model_len)
            params = build_sampling_params(
                body,
                ctx.tokenizer,
                max_tokens=max_tokens,
                logprobs=body.logprobs,
                prompt_logprobs=prompt_logprobs,
                structured_outputs=structure.params if structure else None,
            )
            for i in range(body.n):
                index = p * body.n + i
                specs.append(
                    ChoiceSpec(
                        index,
                        f"{base}-{index}",
                        prompt.token_ids,
                        params.for_choice(i),
                        stop_strings(body.stop),
                        body.include_stop_str_in_output,
                        body.skip_special_tokens,
                    )
                )
        gen = Generation(ctx.engine, ctx.tokenizer, ctx.metrics, specs, arrival)
        await gen.start()
        fmt = _Formatter(ctx, body, prompts, gen)
        head = {
            "id": f"cmpl-{request_id(request)}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": ctx.served_model_name,
        }
        prompt_lens = [len(p.token_ids) for p in prompts]

        def final_usage() -> Payload:
            return usage(prompt_lens, gen.choices)

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = event_stream(
                ctx,
                gen,
                [],
                lambda u: {**head, "choices": [fmt.choice(u)]},
                (lambda: {**head, "choices": [], "usage": final_usage()})
                if include_usage
                else None,
            )
            return EventStreamResponse(events, on_close=gen.close)
        return await respond_once(
            request,
            ctx,
            gen,
            lambda results: {
                **head,
                "choices": [fmt.choice(u) for u in results],
                "usage": final_usage(),
            },
        )

    return api
