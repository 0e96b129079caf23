"""POST /v1/chat/completions: the model's chat template, n choices, logprobs, streaming,
structured outputs and tool calls."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from services.gateway.choice import ChoiceUpdate
from services.gateway.context import GatewayContext
from services.gateway.errors import APIError
from services.gateway.generation import Generation
from services.gateway.logprobs import chat_logprobs, prompt_logprobs_body
from services.gateway.models import ServedModels
from services.gateway.schemas import ChatCompletionRequest
from services.gateway.serving import (
    Endpoint,
    Payload,
    Prompt,
    ResponseFormatter,
    Sampling,
    check_num_choices,
)
from services.gateway.structured import Structure, only_one, requested_structure
from services.gateway.tool_calls import OutputParser, parse_all
from services.gateway.tool_choice import ToolMode, output_parser, tool_mode, tool_schema
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


class ChatFormatter(ResponseFormatter):
    """Chat chunks and responses: the assistant's content, tool calls its parser finds, and
    logprobs of the top `num_top` tokens (None: no logprobs)."""

    id_prefix = "chatcmpl"
    chunk_object = "chat.completion.chunk"
    response_object = "chat.completion"

    def __init__(
        self,
        ctx: GatewayContext,
        request: Request,
        prompts: list[Prompt],
        gen: Generation,
        *,
        body: ChatCompletionRequest,
        num_top: int | None,
        mode: ToolMode,
    ) -> None:
        super().__init__(ctx, request, prompts, gen)
        self.body, self.num_top = body, num_top
        self.parsers = [output_parser(mode, ctx.auto_tool_parser) for _ in range(body.n)]

    def opening(self) -> list[Payload]:
        head = self.head(self.chunk_object)
        return [
            {
                **head,
                "choices": [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            }
            for i in range(self.body.n)
        ]

    def chunk(self, update: ChoiceUpdate) -> Payload | None:
        parser = self.parsers[update.index]
        parsed = parser.feed(update.text)
        if update.finish_reason is not None:
            parsed.extend(parser.finish())
        delta: Payload = {"content": parsed.content} if parsed.content else {}
        if parsed.calls:
            delta["tool_calls"] = [c.payload() for c in parsed.merged_calls()]
        if not delta and update.finish_reason is None and self.num_top is None:
            return None  # held back by the parser
        return {
            **self.head(self.chunk_object),
            "choices": [
                {
                    "index": update.index,
                    "delta": delta,
                    "logprobs": self._logprobs(update),
                    "finish_reason": _finish_reason(update.finish_reason, parser),
                    "stop_reason": update.stop_reason,
                }
            ],
        }

    def response(self, results: list[ChoiceUpdate]) -> Payload:
        return {
            **self.head(self.response_object),
            "choices": [self._choice(u) for u in results],
            "usage": self.usage(),
            "prompt_logprobs": self._prompt_logprobs(),
        }

    def _choice(self, update: ChoiceUpdate) -> Payload:
        parser = self.parsers[update.index]
        content, calls = parse_all(parser, update.text)
        message: Payload = {"role": "assistant", "content": content or None if calls else content}
        if calls:
            message["tool_calls"] = calls
        return {
            "index": update.index,
            "message": message,
            "logprobs": self._logprobs(update),
            "finish_reason": _finish_reason(update.finish_reason, parser),
            "stop_reason": update.stop_reason,
        }

    def _logprobs(self, update: ChoiceUpdate) -> Payload | None:
        if self.num_top is None:
            return None
        tokenizer = self.ctx.tokenizer
        return {
            "content": chat_logprobs(tokenizer, update.token_ids, update.logprobs, self.num_top)
        }

    def _prompt_logprobs(self) -> list[Any] | None:
        if self.body.prompt_logprobs is None:
            return None
        prompt_ids = self.prompts[0].token_ids
        return prompt_logprobs_body(
            self.ctx.tokenizer, prompt_ids, self.gen.choices[0].prompt_logprobs
        )


class ChatEndpoint(Endpoint[ChatCompletionRequest]):
    """One chat request: one prompt, the chat template's rendering of the messages."""

    num_top: int | None = None  # top logprobs per token; None: no logprobs
    mode: ToolMode

    def check(self) -> None:
        check_num_choices(1, self.body.n)
        self.num_top = _num_top_logprobs(self.body)

    def structure(self) -> Structure | None:
        self.mode = tool_mode(self.body)
        return _structure(self.body, self.mode)

    async def prompts(self) -> list[Prompt]:
        body = self.body
        text = self.ctx.render_chat(
            body.messages, body.add_generation_prompt, body.continue_final_message, body.tools
        )
        return [Prompt(text, await self.ctx.encode(text, body.add_special_tokens, "messages"))]

    def sampling(self) -> Sampling:
        body = self.body
        requested, field = body.max_completion_tokens, "max_completion_tokens"
        if requested is None:
            requested, field = body.max_tokens, "max_tokens"
        return Sampling(
            max_tokens=requested,
            logprobs=self.num_top,
            prompt_logprobs=body.prompt_logprobs,
            prompt_param="messages",
            api_names={"max_tokens": field, "logprobs": "top_logprobs"},
        )

    def formatter(self, prompts: list[Prompt], gen: Generation) -> ResponseFormatter:
        return ChatFormatter(
            self.ctx,
            self.request,
            prompts,
            gen,
            body=self.body,
            num_top=self.num_top,
            mode=self.mode,
        )


def router(models: ServedModels) -> APIRouter:
    api = APIRouter()

    @api.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        return await ChatEndpoint(models, body, request).serve()

    return api
