"""What every endpoint shares about one served model: engine, tokenizer, model identity, limits
and metrics."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jinja2

from services.gateway.engine_client import EngineClient
from services.gateway.errors import APIError
from services.gateway.metrics import GatewayMetrics, ModelMetrics
from services.gateway.prompt_encoder import PromptEncoder
from services.gateway.schemas import ChatMessage, FunctionCall, Tool
from services.gateway.structured import StructureChecker
from services.gateway.tool_calls import OutputParser
from services.gateway.tool_parsers import detect_tool_parser, tool_parser
from shared import tracing
from shared.tokenizer import Tokenizer


@dataclass
class GatewayContext:
    engine: EngineClient
    tokenizer: Tokenizer
    served_model_name: str
    metrics: GatewayMetrics
    configured_max_model_len: int | None = None
    model_root: str | None = None
    tokenizer_concurrency: int = 2
    keepalive_interval: float = 0.0  # seconds; 0: no SSE keepalive comments
    tool_call_parser: str | None = None  # None: the one the chat template suggests
    draining: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    model_metrics: ModelMetrics = field(init=False)
    encoder: PromptEncoder = field(init=False)
    structures: StructureChecker = field(init=False)
    auto_tool_parser: Callable[[], OutputParser] = field(init=False)

    def __post_init__(self) -> None:
        self.model_metrics = self.metrics.model(self.served_model_name)
        self.metrics.add_engine(self.served_model_name, self.engine)
        self.encoder = PromptEncoder(self.tokenizer, self.max_model_len, self.tokenizer_concurrency)
        self.structures = StructureChecker(self.tokenizer_concurrency)
        if self.tool_call_parser is None:
            self.tool_call_parser = detect_tool_parser(self.tokenizer.chat_template)
        self.auto_tool_parser = tool_parser(self.tool_call_parser)

    def max_model_len(self) -> int:
        """The configured context length, else the one the scheduler announced."""
        value = self.configured_max_model_len or self.engine.max_model_len
        if not value:
            raise APIError(
                503, "the model's context length is not known yet (no scheduler heartbeat)"
            )
        return value

    def check_accepting(self) -> None:
        if self.draining:
            raise APIError(503, "the gateway is shutting down")

    async def encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        """Token ids of client text; a text that cannot fit the context is a 400 (see
        `PromptEncoder`)."""
        if tracing.tracer is None:
            return await self.encoder.encode(text, add_special_tokens, param)
        with tracing.tracer.span("tokenize", {"skiff.prompt_chars": len(text)}) as span:
            token_ids = await self.encoder.encode(text, add_special_tokens, param)
            span.set_attribute("gen_ai.usage.prompt_tokens", len(token_ids))
            return token_ids

    def render_chat(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        continue_final_message: bool,
        tools: list[Tool] | None = None,
    ) -> str:
        """The chat template applied to the messages; template failures are the client's 400."""
        if continue_final_message and add_generation_prompt:
            raise APIError(
                400,
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                "continue_final_message",
            )
        conversation = [_message_dict(m) for m in messages]
        tool_dicts = [t.model_dump(exclude_none=True) for t in tools] if tools else None
        chars = sum(_size(v) for m in conversation for v in m.values()) + (
            _size(tool_dicts) if tool_dicts else 0
        )
        self.encoder.check_chars(chars, "messages", "messages")
        try:
            text = self.tokenizer.apply_chat_template(
                conversation, add_generation_prompt, tool_dicts
            )
        except (jinja2.TemplateError, ValueError, TypeError) as e:
            raise APIError(400, f"chat template error: {e}", "messages") from None
        if continue_final_message:
            final = conversation[-1]["content"]
            end = text.rfind(final) if final else -1
            if end < 0:
                raise APIError(
                    400,
                    "continue_final_message is set but the final message is "
                    "not in the rendered chat",
                    "messages",
                )
            text = text[: end + len(final)]
        return text


def _message_dict(message: ChatMessage) -> dict[str, Any]:
    content = message.content
    if isinstance(content, list):
        content = "\n".join(part.text for part in content)
    out: dict[str, Any] = {"role": message.role, "content": content or ""}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": call.type,
                "function": {"name": call.function.name, "arguments": _arguments(call.function)},
            }
            for call in message.tool_calls
        ]
    return out


def _size(value: Any) -> int:
    """Characters of a text, or of a structure as JSON."""
    return len(value) if isinstance(value, str) else len(json.dumps(value))


def _arguments(function: FunctionCall) -> Any:
    """Arguments as templates expect them (an object, as vLLM passes them), else the text."""
    try:
        return json.loads(function.arguments)
    except json.JSONDecodeError:
        return function.arguments
