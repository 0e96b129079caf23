"""What completions and chat completions share: streaming vs. collecting, usage, request ids."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator, Callable
from typing import Any

from fastapi import Request
from starlette.responses import JSONResponse, Response

from services.gateway.choice import ChoiceState, ChoiceUpdate
from services.gateway.context import GatewayContext
from services.gateway.errors import APIError, error_body
from services.gateway.generation import Generation
from services.gateway.schemas import MAX_N
from services.gateway.sse import DONE, KEEPALIVE, run_until_disconnect, sse
from shared.logs import request_id_var

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
