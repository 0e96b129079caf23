"""POST /tokenize and POST /detokenize, in vLLM's shapes."""

from __future__ import annotations

from fastapi import APIRouter

from services.gateway.errors import APIError
from services.gateway.models import ServedModels
from services.gateway.prompt_encoder import SMALL_INPUT
from services.gateway.schemas import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from services.gateway.serving import Payload
from shared.sampling_params import check_token_ids


def router(models: ServedModels) -> APIRouter:
    api = APIRouter()

    @api.post("/tokenize")
    async def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest) -> Payload:
        ctx, _ = models.resolve(body.model)
        if isinstance(body, TokenizeChatRequest):
            text = ctx.render_chat(
                body.messages,
                body.add_generation_prompt,
                body.continue_final_message,
                body.tools,
            )
            param = "messages"
        else:
            text, param = body.prompt, "prompt"
        tokens = await ctx.encode(text, body.add_special_tokens, param)
        return {
            "count": len(tokens),
            "max_model_len": ctx.configured_max_model_len or ctx.engine.max_model_len,
            "tokens": tokens,
            "token_strs": ctx.tokenizer.token_strs(tokens) if body.return_token_strs else None,
        }

    @api.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Payload:
        ctx, _ = models.resolve(body.model)
        if len(body.tokens) > SMALL_INPUT and len(body.tokens) > ctx.max_model_len():
            raise APIError(
                400,
                f"{len(body.tokens)} tokens are more than the model's context length "
                f"({ctx.max_model_len()})",
                "tokens",
            )
        check_token_ids(body.tokens, ctx.tokenizer.vocab_size, "tokens")
        return {"prompt": ctx.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    return api
