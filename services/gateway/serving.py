"""What completions and chat completions share.

The front half, `Endpoint.serve()`: admission and checks, the structure a request asks for,
prompt token ids, sampling parameters per prompt, and one engine request per choice. The back
half: streaming or collecting the choices, shaped by each route's `ResponseFormatter`, with
usage and request ids.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

from fastapi import Request
from starlette.responses import JSONResponse, Response

from services.gateway.choice import ChoiceSpec, ChoiceState, ChoiceUpdate
from services.gateway.context import GatewayContext
from services.gateway.errors import APIError, error_body
from services.gateway.generation import Generation
from services.gateway.models import ServedModels
from services.gateway.sampling import (
    api_field_names,
    build_sampling_params,
    check_sizes,
    stop_strings,
)
from services.gateway.schemas import MAX_N, SamplingFields
from services.gateway.sse import DONE, KEEPALIVE, EventStreamResponse, run_until_disconnect, sse
from services.gateway.structured import Structure
from services.gateway.tenants import ticket_of
from shared.logs import request_id_var
from shared.sampling_params import resolve_max_tokens

MAX_CHOICES = MAX_N  # prompts x n per HTTP request

Payload = dict[str, Any]


def request_id(request: Request) -> str:
    return getattr(request.state, "request_id", None) or uuid.uuid4().hex


def engine_base_id() -> str:
    """`<request id>-<fresh suffix>` (choice i is `<base>-<i>`): the scheduler's and workers'
    log lines about the engine requests start with the HTTP request's id, and engine ids are
    unique whatever X-Request-Id says."""
    request_id = request_id_var.get()
    return f"{request_id}-{uuid.uuid4().hex[:12]}" if request_id else uuid.uuid4().hex


def check_num_choices(num_prompts: int, n: int) -> None:
    if num_prompts * n > MAX_CHOICES:
        raise APIError(
            400,
            f"at most {MAX_CHOICES} choices per request (prompts x n), got {num_prompts * n}",
            "n",
        )


def usage(prompt_lens: list[int], choices: list[ChoiceState]) -> Payload:
    """Prompt tokens count once per prompt; cached tokens are the best hit among its choices."""
    per_prompt = len(choices) // max(len(prompt_lens), 1)
    groups = [choices[i * per_prompt : (i + 1) * per_prompt] for i in range(len(prompt_lens))]
    cached = sum(max((c.num_cached_tokens for c in group), default=0) for group in groups)
    prompt_tokens = sum(prompt_lens)
    completion_tokens = sum(c.num_tokens for c in choices)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


async def collect(gen: Generation) -> list[ChoiceUpdate]:
    """Run every choice to the end; one merged update per choice, in index order."""
    merged = {c.spec.index: ChoiceUpdate(c.spec.index) for c in gen.choices}
    async for update in gen.updates():
        if update is not None:
            merged[update.index] = merged[update.index].merge(update)
    return [merged[i] for i in sorted(merged)]


async def respond_once(
    request: Request,
    ctx: GatewayContext,
    gen: Generation,
    build: Callable[[list[ChoiceUpdate]], Payload],
) -> Response:
    """Non-streaming: wait for all choices (abort them if the client leaves first)."""
    try:
        results = await run_until_disconnect(request, collect(gen))
    finally:
        gen.close()
    if results is None:
        ctx.metrics.client_disconnects.inc()
        return Response(status_code=499)  # nobody is listening any more
    return JSONResponse(build(results))


async def event_stream(
    ctx: GatewayContext,
    gen: Generation,
    opening: list[Payload],
    chunk: Callable[[ChoiceUpdate], Payload | None],
    final: Callable[[], Payload] | None,
) -> AsyncGenerator[str, None]:
    """SSE events: `opening`, then a chunk whenever a choice has new text or finishes (tokens
    without text yet wait for the next chunk; `chunk` may return None for text it holds back,
    such as a tool call not yet known as one), then `final` (usage), then [DONE]. An engine
    failure mid-stream becomes an error event. While no token comes for the context's
    `keepalive_interval`, a `: keepalive` comment goes out (clients ignore it; proxies and
    clients with read timeouts see a live connection)."""
    try:
        try:
            for payload in opening:
                yield sse(payload)
            pending: dict[int, ChoiceUpdate] = {}
            async for update in gen.updates(ctx.keepalive_interval or None):
                if update is None:
                    yield KEEPALIVE
                    continue
                if update.index in pending:
                    update = pending.pop(update.index).merge(update)
                if not update.text and update.finish_reason is None:
                    pending[update.index] = update
                    continue
                event = chunk(update)
                if event is not None:
                    yield sse(event)
            if final is not None:
                yield sse(final())
        except APIError as e:
            yield sse(error_body(e.status, e.message, e.param))
        yield DONE
    except (GeneratorExit, asyncio.CancelledError):
        ctx.metrics.client_disconnects.inc()
        raise
    finally:
        gen.close()


@dataclass(frozen=True)
class Prompt:
    text: str  # what a completion's echo returns
    token_ids: list[int]


@dataclass(frozen=True)
class Sampling:
    """A route's own inputs to `build_sampling_params` (the shared fields come from the body)."""

    max_tokens: int | None  # as requested; None: what the context leaves
    logprobs: int | None
    prompt_logprobs: int | None
    prompt_param: str = "prompt"  # the field holding the prompt (errors name it)
    api_names: dict[str, str] = field(default_factory=dict)  # see `api_field_names`


def choice_specs(
    ctx: GatewayContext,
    body: SamplingFields,
    prompts: list[Prompt],
    sampling: Sampling,
    structure: Structure | None,
    max_model_len: int,
) -> list[ChoiceSpec]:
    """`body.n` choices per prompt (choice `p * n + i` is choice i of prompt p), each with its
    own engine id and sampling parameters."""
    base, specs = engine_base_id(), []
    for p, prompt in enumerate(prompts):
        with api_field_names(sampling.api_names):
            max_tokens = resolve_max_tokens(
                sampling.max_tokens, len(prompt.token_ids), max_model_len, sampling.prompt_param
            )
            params = build_sampling_params(
                body,
                ctx.tokenizer,
                max_tokens=max_tokens,
                logprobs=sampling.logprobs,
                prompt_logprobs=sampling.prompt_logprobs,
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
    return specs


class ResponseFormatter(ABC):
    """A route's response payloads: stream chunks of choice updates, and the whole response."""

    id_prefix: ClassVar[str]
    chunk_object: ClassVar[str]
    response_object: ClassVar[str]

    def __init__(
        self, ctx: GatewayContext, request: Request, prompts: list[Prompt], gen: Generation
    ) -> None:
        self.ctx, self.prompts, self.gen = ctx, prompts, gen
        self.id = f"{self.id_prefix}-{request_id(request)}"
        self.created = int(time.time())

    def head(self, kind: str) -> Payload:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.gen.model or self.ctx.served_model_name,
        }

    def usage(self) -> Payload:
        return usage([len(p.token_ids) for p in self.prompts], self.gen.choices)

    def opening(self) -> list[Payload]:
        """Chunks sent before any token."""
        return []

    @abstractmethod
    def chunk(self, update: ChoiceUpdate) -> Payload | None:
        """The stream chunk of an update, or None for text held back."""

    def usage_chunk(self) -> Payload:
        return {**self.head(self.chunk_object), "choices": [], "usage": self.usage()}

    @abstractmethod
    def response(self, results: list[ChoiceUpdate]) -> Payload:
        """The whole response, from one merged update per choice."""


BodyT = TypeVar("BodyT", bound=SamplingFields)


class Endpoint(ABC, Generic[BodyT]):
    """One request to a generation route. `serve()` runs what both routes do, in this order:
    admission, the route's own checks (`check`), the context length, list and text sizes, the
    structure the request asks for (`structure`, compiled off the event loop), the prompts
    (`prompts`), sampling parameters per prompt (`sampling`), submitting every choice, then the
    response, streamed or whole, shaped by the route's `formatter`."""

    def __init__(self, models: ServedModels, body: BodyT, request: Request) -> None:
        """The served model and LoRA adapter `body.model` names (404 when none)."""
        self.ctx, self.lora_name = models.resolve(body.model)
        self.body, self.request = body, request
        self.arrival = time.monotonic()

    def check(self) -> None:
        """The route's own checks, before the context length is needed."""

    @abstractmethod
    def structure(self) -> Structure | None: ...

    @abstractmethod
    async def prompts(self) -> list[Prompt]: ...

    @abstractmethod
    def sampling(self) -> Sampling: ...

    @abstractmethod
    def formatter(self, prompts: list[Prompt], gen: Generation) -> ResponseFormatter: ...

    async def serve(self) -> Response:
        ctx, body = self.ctx, self.body
        ctx.check_accepting()
        lora_name = self.lora_name
        ticket = ticket_of(self.request)
        if ticket is not None:
            ticket.check_model(lora_name or ctx.served_model_name)
        self.check()
        max_model_len = ctx.max_model_len()
        check_sizes(body, ctx.encoder)
        structure = self.structure()
        if structure is not None:
            await ctx.structures.check(structure)
        prompts = await self.prompts()
        specs = choice_specs(ctx, body, prompts, self.sampling(), structure, max_model_len)
        on_tokens = ticket.generation_tokens if ticket is not None else None
        gen = Generation(
            ctx.engine,
            ctx.tokenizer,
            ctx.metrics,
            ctx.model_metrics,
            specs,
            self.arrival,
            body.priority,
            on_tokens,
            lora_name,
        )
        await gen.start()
        if ticket is not None:  # once per prompt, as usage counts them
            ticket.prompt_tokens(sum(len(p.token_ids) for p in prompts))
        fmt = self.formatter(prompts, gen)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            final = fmt.usage_chunk if include_usage else None
            events = event_stream(ctx, gen, fmt.opening(), fmt.chunk, final)
            return EventStreamResponse(events, on_close=gen.close)
        return await respond_once(self.request, ctx, gen, fmt.response)
