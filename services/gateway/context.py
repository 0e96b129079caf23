"""What every endpoint shares: engine, tokenizer, model identity, limits and metrics."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import jinja2

from services.gateway.engine_client import EngineClient
from services.gateway.errors import APIError
from services.gateway.metrics import GatewayMetrics
from services.gateway.protocol import ChatMessage
from shared.tokenizer import Tokenizer

_THREAD_ENCODE_CHARS = 8192  # encode longer texts off the event loop


@dataclass
class GatewayContext:
    engine: EngineClient
    tokenizer: Tokenizer
    served_model_name: str
    metrics: GatewayMetrics
    configured_max_model_len: int | None = None
    model_root: str | None = None
    draining: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

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

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if len(text) > _THREAD_ENCODE_CHARS:
            return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens)
        return self.tokenizer.encode(text, add_special_tokens)

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
