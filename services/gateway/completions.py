"""POST /v1/completions: prompts as text or token ids, n choices each, echo, logprobs,
structured outputs."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from services.gateway.choice import ChoiceUpdate
from services.gateway.context import GatewayContext
from services.gateway.detokenizer import IncrementalDetokenizer
from services.gateway.errors import APIError
from services.gateway.generation import Generation
from services.gateway.logprobs import completion_logprobs, prompt_logprobs_body
from services.gateway.models import ServedModels
from services.gateway.schemas import CompletionRequest
from services.gateway.serving import (
    Endpoint,
    Payload,
    Prompt,
    ResponseFormatter,
    Sampling,
    check_num_choices,
)
from services.gateway.structured import Structure, requested_structure
from shared.sampling_params import check_prompt_fits, check_token_ids


def _batch(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """The prompts of a request: one text, one list of token ids, or a list of either."""
    if isinstance(prompt, str):
        return [prompt]
    token_ids = [t for t in prompt if isinstance(t, int)]
    if token_ids:  # one prompt of token ids (a list holds one kind of item)
        return [token_ids]
    return [p for p in prompt if not isinstance(p, int)]


async def _prompts(ctx: GatewayContext, body: CompletionRequest) -> list[Prompt]:
    """The prompts, each bounded by the context length before it is tokenized or decoded."""
    raw = _batch(body.prompt)
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


class CompletionFormatter(ResponseFormatter):
    """Completion chunks and responses: each choice's text (after its prompt on the first one
    with `echo`) and logprobs."""

    id_prefix = "cmpl"
    chunk_object = response_object = "text_completion"

    def __init__(
        self,
        ctx: GatewayContext,
        request: Request,
        prompts: list[Prompt],
        gen: Generation,
        *,
        body: CompletionRequest,
    ) -> None:
        super().__init__(ctx, request, prompts, gen)
        self.body = body
        self.started: set[int] = set()

    def chunk(self, update: ChoiceUpdate) -> Payload:
        return {**self.head(self.chunk_object), "choices": [self.choice(update)]}

    def response(self, results: list[ChoiceUpdate]) -> Payload:
        return {
            **self.head(self.response_object),
            "choices": [self.choice(u) for u in results],
            "usage": self.usage(),
        }

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


class CompletionEndpoint(Endpoint[CompletionRequest]):
    """One completions request: prompts as text or token ids, `n` choices each."""

    def check(self) -> None:
        if self.body.suffix:
            raise APIError(400, "suffix is not currently supported", "suffix")

    def structure(self) -> Structure | None:
        return requested_structure(self.body)

    async def prompts(self) -> list[Prompt]:
        return await _prompts(self.ctx, self.body)

    def sampling(self) -> Sampling:
        body = self.body
        prompt_logprobs = body.prompt_logprobs
        if body.echo and body.logprobs is not None and prompt_logprobs is None:
            prompt_logprobs = body.logprobs
        return Sampling(
            max_tokens=body.max_tokens, logprobs=body.logprobs, prompt_logprobs=prompt_logprobs
        )

    def formatter(self, prompts: list[Prompt], gen: Generation) -> ResponseFormatter:
        return CompletionFormatter(self.ctx, self.request, prompts, gen, body=self.body)


def router(models: ServedModels) -> APIRouter:
    api = APIRouter()

    @api.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        return await CompletionEndpoint(models, body, request).serve()

    return api
