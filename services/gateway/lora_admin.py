"""vLLM's runtime LoRA endpoints: POST /v1/load_lora_adapter and /v1/unload_lora_adapter.

Every scheduler shard of the model takes the change or none does (`EngineClient.change_lora`);
with API keys on, only an admin key may call them (`middleware.ADMIN_PATHS`). Paths must lie
under the schedulers' `--lora-root`. A load goes to the served model the body's `model` names
(default: the first), an unload to the model serving the adapter."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from services.gateway.context import GatewayContext
from services.gateway.errors import APIError
from services.gateway.models import ServedModels
from services.gateway.request_stream import EngineError
from services.gateway.schemas import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from shared.wire import LoRAAdapterChange


def router(models: ServedModels) -> APIRouter:
    api = APIRouter()

    @api.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        if any(body.lora_name == ctx.served_model_name for ctx in models):
            raise APIError(400, f"{body.lora_name!r} is a served model's name", "lora_name")
        owner = models.adapter_owner(body.lora_name)
        ctx = models.base(body.model)
        if owner is not None and owner is not ctx:
            raise APIError(
                409, f"{body.lora_name!r} is an adapter of {owner.served_model_name}", "lora_name"
            )
        change = LoRAAdapterChange(lora_name=body.lora_name, lora_path=body.lora_path)
        await _change(ctx, change)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @api.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        change = LoRAAdapterChange(lora_name=body.lora_name, load=False)
        await _change(models.adapter_owner(body.lora_name) or models.default, change)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    return api


async def _change(ctx: GatewayContext, change: LoRAAdapterChange) -> None:
    try:
        await ctx.engine.change_lora(change)
    except EngineError as e:
        raise APIError(e.status, e.message, "lora_name" if e.status == 404 else None) from None
