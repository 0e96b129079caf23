"""The gateway's spans (only when `shared.tracing` is on): the HTTP request, and per engine
request a `generate` span from submit to the last token, whose context travels to the
scheduler in `SubmitRequest.traceparent`. Tokenization is a `tokenize` span
(`GatewayContext.encode`); detokenization is timed inside `generate` (its
`skiff.detokenize_seconds`), with a `first_token` event.
"""

from __future__ import annotations

import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.gateway.choice import ChoiceSpec, ChoiceState, ChoiceUpdate
from shared import tracing
from shared.logs import request_id_var
from shared.wire import TokenDelta


class TracingMiddleware:
    """A SERVER span per HTTP request (`POST /v1/completions`), continuing the client's
    `traceparent` header if it sends one; inside `RequestContextMiddleware`, so it knows the
    request id."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        tracer = tracing.tracer
        if scope["type"] != "http" or tracer is None:
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        parent = headers.get(b"traceparent", b"").decode("latin-1") or None
        span = tracer.start(
            f"{scope['method']} {scope['path']}",
            parent=parent,
            kind=tracer.server,
            attributes={
                "http.request.method": scope["method"],
                "url.path": scope["path"],
                "skiff.request_id": request_id_var.get() or "",
            },
        )

        async def send_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                span.set_attribute("http.response.status_code", message["status"])
            await send(message)

        try:
            with tracer.use(span):
                await self.app(scope, receive, send_status)
        finally:
            route = getattr(scope.get("route"), "path", None)
            if route:
                span.update_name(f"{scope['method']} {route}")
                span.set_attribute("http.route", route)
            span.end()


class ChoiceSpans:
    """The `generate` spans of one HTTP request's choices, children of the current span."""

    def __init__(self, tracer: tracing.Tracer, specs: list[ChoiceSpec]) -> None:
        self.tracer = tracer
        self.spans: list[Any] = [
            tracer.start(
                "generate",
                attributes={
                    "gen_ai.request.id": s.req_id,
                    "gen_ai.usage.prompt_tokens": len(s.prompt_ids),
                    "gen_ai.request.max_tokens": s.params.max_tokens or 0,
                },
            )
            for s in specs
        ]
        self._detokenize_s = [0.0] * len(specs)
        self._ended = False

    def traceparent(self, index: int) -> str | None:
        return self.tracer.traceparent(self.spans[index])

    def process(self, choice: ChoiceState, delta: TokenDelta) -> ChoiceUpdate:
        """`choice.process(delta)`, timed; the first tokens are an event."""
        index, started = choice.spec.index, time.perf_counter()
        update = choice.process(delta)
        self._detokenize_s[index] += time.perf_counter() - started
        if update.token_ids and choice.num_tokens == len(update.token_ids):
            self.spans[index].add_event("first_token")
        return update

    def end(self, choices: list[ChoiceState], error: str | None = None) -> None:
        """End every span once, with its finish reason and token counts."""
        if self._ended:
            return
        self._ended = True
        for choice, span, detokenize_s in zip(choices, self.spans, self._detokenize_s, strict=True):
            span.set_attribute("gen_ai.response.finish_reasons", [choice.finish_reason or "abort"])
            span.set_attribute("gen_ai.usage.completion_tokens", choice.num_tokens)
            span.set_attribute("skiff.detokenize_seconds", detokenize_s)
            if error is not None:
                span.set_attribute("error.type", error)
            span.end()
