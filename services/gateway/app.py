"""The gateway's FastAPI app: OpenAI-compatible endpoints over an `EngineClient`.

    app = create_app(engine_client, tokenizer, GatewayConfig(max_model_len=2048))

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions, POST /tokenize,
POST /detokenize, GET /health (503 until the engine is ready or while draining), GET /version,
GET /metrics, GET /admin/tenants. With `api_key` or `api_keys_file`, /v1/* and /admin/* need
`Authorization: Bearer <key>` of a tenant (see `key_file` and `tenants`); /admin/* an admin's.
"""

from __future__ import annotations

import importlib.metadata

from fastapi import APIRouter, FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import Response

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
from services.gateway.serving import Payload
from services.gateway.tenants import Tenants, ticket_of
from services.gateway.tracing import TracingMiddleware
from shared import tracing
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
) -> FastAPI:
    """Build the app of a gateway configured by `config`. `config.max_model_len=None` takes
    the context length from the scheduler's heartbeat; `keepalive_interval` > 0 sends an SSE
    comment on streams that wait that long for tokens; `tenants` are those of its API keys
    (default: read from `config`; `KeyFileError` when the file is unusable). The shared state
    is `app.state.gateway` (a `GatewayContext`); set its `draining` to make /health fail and
    new requests get 503 during shutdown. `app.state.tenants` admits each tenant's requests."""
    served_model_name = config.resolved_model_name
    if tenants is None:
        tenants = tenants_of(config.api_key, config.api_keys_file)
    names = [t.name for t in tenants] or [ANONYMOUS]
    metrics = GatewayMetrics(served_model_name, engine_client, names)
    ctx = GatewayContext(
        engine_client,
        tokenizer,
        served_model_name,
        metrics,
        configured_max_model_len=config.max_model_len,
        model_root=str(config.resolved_model_dir),
        tokenizer_concurrency=config.tokenizer_concurrency,
        keepalive_interval=config.keepalive_interval,
        tool_call_parser=config.tool_call_parser,
    )
    app = FastAPI(
        title="skiff gateway",
        version=_version(),
        summary="OpenAI-compatible API of skiff (vLLM-compatible)",
    )
    app.state.gateway = ctx
    app.state.tenants = Tenants(tenants, metrics)
    install_error_handlers(app)
    for module in (completions, chat, tokenization, lora_admin):
        app.include_router(module.router(ctx))
    app.include_router(_service_router(ctx, app.state.tenants))
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


def _service_router(ctx: GatewayContext, tenants: Tenants) -> APIRouter:
    api = APIRouter()

    @api.get("/v1/models")
    async def list_models(request: Request) -> Payload:
        """The base model and its LoRA adapters (`parent`: the base model), those the API
        key may use."""
        ticket = ticket_of(request)
        max_model_len = ctx.configured_max_model_len or ctx.engine.max_model_len
        base = ctx.served_model_name
        models: list[tuple[str, str, str | None]] = [(base, ctx.model_root or base, None)]
        models += [(name, path, base) for name, path in sorted(ctx.engine.lora_adapters.items())]
        return {
            "object": "list",
            "data": [
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
                if ticket is None or ticket.allows(name)
            ],
        }

    @api.get("/admin/tenants")
    async def list_tenants() -> Payload:
        """Each tenant's limits and what it uses now (admins only)."""
        return {"object": "list", "data": tenants.usage()}

    @api.get("/health")
    async def health() -> Response:
        if ctx.draining:
            return error_response(503, "the gateway is shutting down")
        if not ctx.engine.ready:
            return error_response(503, "no scheduler with ready workers is available")
        return Response(status_code=200)

    @api.get("/version")
    async def version() -> Payload:
        return {"version": _version()}

    @api.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(ctx.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return api
