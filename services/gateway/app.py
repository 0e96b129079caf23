"""The gateway's FastAPI app: OpenAI-compatible endpoints over an `EngineClient`.

    app = create_app(engine_client, tokenizer, GatewayConfig(max_model_len=2048))

Several models: `config.extra_models` and an engine client and tokenizer for each
(`create_app(..., extra=[(engine, tokenizer)])`); a request's `model` picks one
(`models.ServedModels`).

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions, POST /tokenize,
POST /detokenize, GET /health (503 until some model's engine is ready, or while draining;
`?model=` asks about one), GET /version, GET /metrics, GET /admin/tenants, POST
/v1/load_lora_adapter and /v1/unload_lora_adapter. With `api_key` or `api_keys_file`, /v1/*
and /admin/* need `Authorization: Bearer <key>` of a tenant (see `key_file` and `tenants`);
/admin/* and the adapter routes an admin's.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Sequence

from fastapi import APIRouter, FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import JSONResponse, Response

from services.gateway import chat, completions, lora_admin, tokenization
from services.gateway.config import GatewayConfig
from services.gateway.context import GatewayContext
from services.gateway.engine_client import EngineClient
from services.gateway.errors import error_response, install_error_handlers
from services.gateway.key_file import ANONYMOUS, Tenant, tenants_of
from services.gateway.metrics import GatewayMetrics
from services.gateway.middleware import (
    BodyLimitMiddleware,
    RequestContextMiddleware,
    TenantMiddleware,
)
from services.gateway.models import ServedModels
from services.gateway.serving import Payload
from services.gateway.tenants import Tenants, ticket_of
from services.gateway.tracing import TracingMiddleware
from shared import callout_watch, tracing
from shared.tokenizer import Tokenizer


def _version() -> str:
    try:
        return importlib.metadata.version("skiff")
    except importlib.metadata.PackageNotFoundError:
        return "0.1.0"


def create_app(
    engine_client: EngineClient,
    tokenizer: Tokenizer,
    config: GatewayConfig,
    tenants: list[Tenant] | None = None,
    extra: Sequence[tuple[EngineClient, Tokenizer]] = (),
) -> FastAPI:
    """Build the app of a gateway configured by `config`. `config.max_model_len=None` takes
    the context length from the scheduler's heartbeat; `keepalive_interval` > 0 sends an SSE
    comment on streams that wait that long for tokens; `tenants` are those of its API keys
    (default: read from `config`; `KeyFileError` when the file is unusable). The shared state
    is `app.state.gateway` (a `GatewayContext`); set its `draining` to make /health fail and
    new requests get 503 during shutdown (`app.state.models`, a `ServedModels`, holds every
    model's; its `draining` sets them all). `app.state.tenants` admits each tenant's requests.
    `extra`: the engine client and tokenizer of each of `config.extra_models`."""
    if tenants is None:
        tenants = tenants_of(config.api_key, config.api_keys_file)
    metrics = GatewayMetrics([t.name for t in tenants] or [ANONYMOUS])
    models = _served_models(config, [(engine_client, tokenizer), *extra], metrics)
    app = FastAPI(
        title="skiff gateway",
        version=_version(),
        summary="OpenAI-compatible API of skiff (vLLM-compatible)",
    )
    app.state.gateway = models.default
    app.state.models = models
    app.state.tenants = Tenants(tenants, metrics)
    install_error_handlers(app)
    for module in (completions, chat, tokenization, lora_admin):
        app.include_router(module.router(models))
    app.include_router(_service_router(models, metrics, app.state.tenants))
    app.add_middleware(
        BodyLimitMiddleware,
        max_body_bytes=config.max_body_bytes,
        body_timeout=config.body_timeout,
    )
    app.add_middleware(TenantMiddleware, tenants=app.state.tenants)  # before reading bodies
    if tracing.tracer is not None:
        app.add_middleware(TracingMiddleware)
    app.add_middleware(RequestContextMiddleware, metrics=metrics)  # outermost
    return app


def _served_models(
    config: GatewayConfig,
    engines: Sequence[tuple[EngineClient, Tokenizer]],
    metrics: GatewayMetrics,
) -> ServedModels:
    """A `GatewayContext` per model of `config.models`, with its engine client and tokenizer."""
    routes = config.models
    if len(engines) != len(routes):
        extra = len(routes) - 1
        raise ValueError(f"{extra} extra models need as many engines, got {len(engines) - 1}")
    return ServedModels(
        [
            GatewayContext(
                engine,
                tokenizer,
                route.name,
                metrics,
                configured_max_model_len=route.max_model_len,
                model_root=route.model_dir,
                tokenizer_concurrency=config.tokenizer_concurrency,
                keepalive_interval=config.keepalive_interval,
                tool_call_parser=config.tool_call_parser,
            )
            for route, (engine, tokenizer) in zip(routes, engines, strict=True)
        ]
    )


def _service_router(models: ServedModels, metrics: GatewayMetrics, tenants: Tenants) -> APIRouter:
    api = APIRouter()

    @api.get("/v1/models")
    async def list_models(request: Request) -> Payload:
        """Every served model and its LoRA adapters (`parent`: the model), those the API key
        may use."""
        ticket = ticket_of(request)
        return {
            "object": "list",
            "data": [
                card
                for ctx in models
                for card in _model_cards(ctx)
                if ticket is None or ticket.allows(card["id"])
            ],
        }

    @api.get("/admin/tenants")
    async def list_tenants() -> Payload:
        """Each tenant's limits and what it uses now (admins only)."""
        return {"object": "list", "data": tenants.usage()}

    @api.get("/health")
    async def health(model: str | None = None) -> Response:
        """200 while not draining and some model (`model`: that one) has a scheduler with
        ready workers; its body warns when the NATS auth callout is lost."""
        if models.draining:
            return error_response(503, "the gateway is shutting down")
        ready = models.ready if model is None else models.base(model).engine.ready
        if not ready:
            return error_response(503, "no scheduler with ready workers is available")
        note = callout_watch.health_note()
        return JSONResponse({"warning": note}) if note else Response(status_code=200)

    @api.get("/version")
    async def version() -> Payload:
        return {"version": _version()}

    @api.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return api


def _model_cards(ctx: GatewayContext) -> list[Payload]:
    """/v1/models entries of a served model and its LoRA adapters."""
    max_model_len = ctx.configured_max_model_len or ctx.engine.max_model_len
    base = ctx.served_model_name
    models: list[tuple[str, str, str | None]] = [(base, ctx.model_root or base, None)]
    models += [(name, path, base) for name, path in sorted(ctx.engine.lora_adapters.items())]
    return [
        {
            "id": name,
            "object": "model",
            "created": ctx.created,
            "owned_by": "skiff",
            "root": root,
            "parent": parent,
            "max_model_len": max_model_len,
        }
        for name, root, parent in models
    ]
