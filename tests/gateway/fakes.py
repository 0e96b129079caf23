"""A scripted engine and HTTP helpers for the gateway tests (the real tokenizer, no NATS)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

from services.gateway.app import create_app
from services.gateway.config import GatewayConfig
from services.gateway.engine_client import EngineError, RequestStream
from shared.default_model import DEFAULT_MODEL_NAME
from shared.tokenizer import Tokenizer
from shared.wire import (
    LoRAAdapterChange,
    SubmitRequest,
    TokenDelta,
    TokenLogprobs,
)

MODEL = DEFAULT_MODEL_NAME
MAX_MODEL_LEN = 256
EOS = 2
C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]


class FakeEngine:
    """Scripted `EngineClient`: every request generates `text` then EOS, one token per delta."""

    def __init__(
        self, tokenizer: Tokenizer, text: str = "Hello world, how are you?", delay: float = 0.0
    ) -> None:
        self.tokenizer = tokenizer
        self.text = text
        self.delay = delay
        self.ready = True
        self.max_model_len: int | None = MAX_MODEL_LEN
        self.lora_adapters: dict[str, str] = {}
        self.reject: EngineError | None = None
        self.fail_after: int | None = None  # lose requests after this many tokens
        self.submitted: list[SubmitRequest] = []
        self.aborted: list[str] = []
        self._tasks: dict[str, asyncio.Task] = {}

    async def submit(self, request: SubmitRequest) -> RequestStream:
        if self.reject is not None:
            raise self.reject
        self.submitted.append(request)
        stream = RequestStream(request.req_id)
        self._tasks[request.req_id] = asyncio.create_task(self._run(request, stream))
        return stream

    async def abort(self, req_ids: list[str]) -> None:
        self.aborted.extend(req_ids)
        for req_id in req_ids:
            task = self._tasks.pop(req_id, None)
            if task is not None:
                task.cancel()

    async def change_lora(self, change: LoRAAdapterChange) -> None:
        """Adapters by name, as a scheduler keeps them (no root, no files)."""
        if change.load:
            if change.lora_name in self.lora_adapters:
                raise EngineError(
                    400, f"The lora adapter '{change.lora_name}' has already been loaded."
                )
            self.lora_adapters[change.lora_name] = change.lora_path
        elif self.lora_adapters.pop(change.lora_name, None) is None:
            raise EngineError(404, f"The lora adapter '{change.lora_name}' cannot be found.")

    async def _run(self, request: SubmitRequest, stream: RequestStream) -> None:
        params = request.sampling_params
        tokens = [*self.tokenizer.encode(self.text, add_special_tokens=False), EOS]
        max_tokens = params.max_tokens or len(tokens)
        for i, token in enumerate(tokens[:max_tokens]):
            await asyncio.sleep(self.delay)
            if self.fail_after is not None and i >= self.fail_after:
                stream.fail(EngineError(503, "lost contact with the scheduler"))
                return
            last = i == len(tokens) - 1 or i == max_tokens - 1
            finish = ("stop" if token == EOS else "length") if last else None
            stream.put(
                TokenDelta(
                    req_id=request.req_id,
                    new_token_ids=[token],
                    finish_reason=finish,
                    num_cached_tokens=3,
                    logprobs=[_logprobs(token, params.logprobs)]
                    if params.logprobs is not None
                    else [],
                    prompt_logprobs=_prompt_logprobs(request, params.prompt_logprobs)
                    if i == 0 and params.prompt_logprobs is not None
                    else None,
                )
            )


def _logprobs(token: int, num_top: int) -> TokenLogprobs:
    top = [token, *range(100, 100 + num_top)][:num_top]
    return TokenLogprobs([token, *top], [-0.5, *[-0.5 - k for k in range(len(top))]], 1)


def _prompt_logprobs(request: SubmitRequest, num_top: int) -> list[TokenLogprobs | None]:
    return [None] + [_logprobs(t, num_top) for t in request.prompt_token_ids[1:]]


def gateway_config(**overrides: Any) -> GatewayConfig:
    """The tests' gateway: MODEL with MAX_MODEL_LEN tokens, no SSE keep-alive comments."""
    fields = {"served_model_name": MODEL, "max_model_len": MAX_MODEL_LEN, "keepalive_interval": 0.0}
    return GatewayConfig(**{**fields, **overrides})


def make_client(engine: FakeEngine, tokenizer: Tokenizer, **kwargs: Any) -> httpx.AsyncClient:
    app = create_app(engine, tokenizer, gateway_config(**kwargs))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def sse_events(body: str) -> list[Any]:
    events = [line[len("data: ") :] for line in body.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]
