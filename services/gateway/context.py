"""What every endpoint shares: engine, tokenizer, model identity, limits and metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import jinja2

from services.gateway.engine_client import EngineClient
from services.gateway.errors import APIError
from services.gateway.metrics import GatewayMetrics
from services.gateway.prompt_encoder import PromptEncoder
from services.gateway.protocol import ChatMessage
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
    draining: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    encoder: PromptEncoder = field(init=False)

    def __post_init__(self) -> None:
        self.encoder = PromptEncoder(self.tokenizer, self.max_model_len, self.tokenizer_concurrency)

    def max_model_len(self) -> int:
        """The configured context length, else the one the scheduler announced."""
        value = self.configured_max_model_len or self.engine.max_model_len
        if not value:
            raise APIError(
                503, "the model's context length is not known yet (no scheduler heartbeat)"
            )
        return value

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.served_model_name:
            raise APIError(404, f"The model `{name}` does not exist.", "model")

    def check_accepting(self) -> None:
        if self.draining:
            raise APIError(503, "the gateway is shutting down")

    async def encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        """Token ids of client text; a text that cannot fit the context is a 400 (see
        `PromptEncoder`)."""
        return await self.encoder.encode(text, add_special_tokens, param)

    def render_chat(
        self, messages: list[ChatMessage], add_generation_prompt: bool, continue_final_message: bool
    ) -> str:
        """The chat template applied to the messages; template failures are the client's 400."""
        if continue_final_message and add_generation_prompt:
            raise APIError(
                400,
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                "continue_final_message",
            )
        conversation = [_message_dict(m) for m in messages]
        chars = sum(len(v) for m in conversation for v in m.values())
        self.encoder.check_chars(chars, "messages", "messages")
        try:
            text = self.tokenizer.apply_chat_template(conversation, add_generation_prompt)
        except (jinja2.TemplateError, ValueError) as e:
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


def _message_dict(message: ChatMessage) -> dict[str, str]:
    content = message.content
    if isinstance(content, list):
        content = "\n".join(part.text for part in content)
    out = {"role": message.role, "content": content or ""}
    if message.name is not None:
        out["name"] = message.name
    return out
