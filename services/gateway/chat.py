"""POST /v1/chat/completions: the model's chat template, n choices, logprobs, streaming,
structured outputs and tool calls."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from starlette.responses import Response

from services.gateway.choice import ChoiceSpec, ChoiceUpdate
from services.gateway.context import GatewayContext
from services.gateway.errors import APIError
from services.gateway.generation import Generation
from services.gateway.logprobs import chat_logprobs, prompt_logprobs_body
from services.gateway.sampling import (
    api_field_names,
    build_sampling_params,
    check_sizes,
    stop_strings,
)
from services.gateway.schemas import ChatCompletionRequest
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
from services.gateway.structured import Structure, only_one, requested_structure
from services.gateway.tool_calls import OutputParser, parse_all
from services.gateway.tool_choice import ToolMode, output_parser, tool_mode, tool_schema
from shared.sampling_params import resolve_max_tokens
from shared.structured_outputs import StructuredOutputsParams


def _num_top_logprobs(body: ChatCompletionRequest) -> int | None:
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(
            400, "when using `top_logprobs`, `logprobs` must be set to true", "top_logprobs"
        )
    return (body.top_logprobs or 0) if body.logprobs else None


def _structure(body: ChatCompletionRequest, mode: ToolMode) -> Structure | None:
    """What the request asks for, or the calls a forced `tool_choice` allows (not both)."""
    found = [s for s in (requested_structure(body),) if s is not None]
    if mode.forced:
        assert body.tools
        schema = tool_schema(body.tools, mode, body.parallel_tool_calls)
        found.append(Structure("tool_choice", StructuredOutputsParams(json=schema)))
    return only_one(found)


def _finish_reason(reason: str | None, parser: OutputParser) -> str | None:
    return "tool_calls" if reason == "stop" and parser.num_calls else reason


def router(ctx: GatewayContext) -> APIRouter:
    api = APIRouter()

    @api.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        ctx.check_accepting()
        ctx.check_model(body.model)
        check_num_choices(1, body.n)
        num_top = _num_top_logprobs(body)
        max_model_len = ctx.max_model_len()
        check_sizes(body, ctx.encoder)
        mode = tool_mode(body)
        structure = _structure(body, mode)
        if structure is not None:
            await ctx.structures.check(structure)
        text = ctx.render_chat(
            body.messages, body.add_generation_prompt, body.continue_final_message, body.tools
        )
        prompt_ids = await ctx.encode(text, body.add_special_tokens, "messages")
        requested, field = body.max_completion_tokens, "max_completion_tokens"
        if requested is None:
            requested, field = body.max_tokens, "max_tokens"
        with api_field_names({"max_tokens": field, "logprobs": "top_logprobs"}):
            max_tokens = resolve_max_tokens(requested, len(prompt_ids), max_model_len, "messages")
            params = build_sampling_params(
                body,
                ctx.tokenizer,
                max_tokens=max_tokens,
                logprobs=num_top,
                prompt_logprobs=body.prompt_logprobs,
                structured_outputs=structure.params if structure else None,
            )
        parsers = [output_parser(mode, ctx.auto_tool_parser) for _ in range(body.n)]
        base = engine_base_id()
        specs = [
            ChoiceSpec(
                i,
                f"{base}-{i}",
                prompt_ids,
                params.for_choice(i),
                stop_strings(body.stop),
                body.include_stop_str_in_output,
                body.skip_special_tokens,
            )
            for i in range(body.n)
        ]
        gen = Generation(ctx.engine, ctx.tokenizer, ctx.metrics, specs, arrival)
        await gen.start()
        created = int(time.time())

        def head(kind: str) -> Payload:
            return {
                "id": f"chatcmpl-{request_id(request)}",
                "object": kind,
                "created": created,
                "model": ctx.served_model_name,
            }

        def logprobs(update: ChoiceUpdate) -> Payload | None:
            if num_top is None:
                return None
            return {
                "content": chat_logprobs(ctx.tokenizer, update.token_ids, update.logprobs, num_top)
            }

        def final_usage() -> Payload:
            return usage([len(prompt_ids)], gen.choices)

        def prompt_logprobs() -> list | None:
            if body.prompt_logprobs is None:
                return None
            return prompt_logprobs_body(ctx.tokenizer, prompt_ids, gen.choices[0].prompt_logprobs)

        if body.stream:
            chunk_head = head("chat.completion.chunk")
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            opening = [
                {
                    **chunk_head,
                    "choices": [
                        {
                            "index": i,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                }
                for i in range(body.n)
            ]

            def chunk(update: ChoiceUpdate) -> Payload | None:
                parser = parsers[update.index]
                parsed = parser.feed(update.text)
                if update.finish_reason is not None:
                    parsed.extend(parser.finish())
                delta: Payload = {"content": parsed.content} if parsed.content else {}
                if parsed.calls:
                    delta["tool_calls"] = [c.payload() for c in parsed.merged_calls()]
                if not delta and update.finish_reason is None and num_top is None:
                    return None  # held back by the parser
                return {
                    **chunk_head,
                    "choices": [
                        {
                            "index": update.index,
                            "delta": delta,
                            "logprobs": logprobs(update),
                            "finish_reason": _finish_reason(update.finish_reason, parser),
                            "stop_reason": update.stop_reason,
                        }
                    ],
                }

            final = (
                (lambda: {**chunk_head, "choices": [], "usage": final_usage()})
                if include_usage
                else None
            )
            events = event_stream(ctx, gen, opening, chunk, final)
            return EventStreamResponse(events, on_close=gen.close)

        def choice(update: ChoiceUpdate) -> Payload:
            parser = parsers[update.index]
            content, calls = parse_all(parser, update.text)
            message: Payload = {
                "role": "assistant",
                "content": content or None if calls else content,
            }
            if calls:
                message["tool_calls"] = calls
            return {
                "index": update.index,
                "message": message,
                "logprobs": logprobs(update),
                "finish_reason": _finish_reason(update.finish_reason, parser),
                "stop_reason": update.stop_reason,
            }

        def build(results: list[ChoiceUpdate]) -> Payload:
            return {
                **head("chat.completion"),
                "choices": [choice(u) for u in results],
                "usage": final_usage(),
                "prompt_logprobs": prompt_logprobs(),
            }

        return await respond_once(request, ctx, gen, build)

    return api
