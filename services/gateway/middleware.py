"""Pure ASGI middlewares (they never buffer streamed responses).

* `RequestContextMiddleware`: X-Request-Id (honoured or generated, echoed), the request id in
  log records, an access log line and the HTTP request counter.
* `TenantMiddleware`: on /v1/* and /admin/*, the tenant of the `Authorization: Bearer <key>`
  (401 without one), admitted by its limits (429) and rights (403) for the whole life of the
  response; the request's `Ticket` is `request.state.tenant`.
* `BodyLimitMiddleware`: reads the body up front; answers 413 past the size limit and 408 (and
  closes the connection) when the body is not complete within `body_timeout` seconds, so that a
  client trickling its body cannot hold a request open.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.gateway.errors import error_response
from services.gateway.metrics import GatewayMetrics
from services.gateway.tenants import Rejection, Tenants
from shared.logs import request_id_var

logger = logging.getLogger("services.gateway.access")

_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")  # visible ASCII, bounded
_DIGITS = re.compile(r"[0-9]{1,20}")
_METHODS = frozenset({"GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"})


class RequestContextMiddleware:
    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = Headers(scope=scope).get("x-request-id", "")
        request_id = given if _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        token = request_id_var.set(request_id)
        started, status = time.monotonic(), 500

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                MutableHeaders(scope=message).append("X-Request-Id", request_id)
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            method = scope["method"] if scope["method"] in _METHODS else "other"
            self.metrics.http_requests.labels(method, route, str(status)).inc()
            logger.info(
                "%s %s %d",
                scope["method"],
                scope["path"],
                status,
                extra={"status": status, "duration_s": round(time.monotonic() - started, 4)},
            )
            request_id_var.reset(token)


ADMIN_PREFIX = "/admin/"
ADMIN_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")  # admin routes under /v1


class TenantMiddleware:
    def __init__(self, app: ASGIApp, tenants: Tenants) -> None:
        self.app = app
        self.tenants = tenants

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"] if scope["type"] == "http" else ""
        admin_route = path.startswith(ADMIN_PREFIX) or path in ADMIN_PATHS
        if not (path.startswith("/v1") or admin_route):
            await self.app(scope, receive, send)
            return
        state = self.tenants.authenticate(Headers(scope=scope).get("authorization", ""))
        if state is None:
            unknown = error_response(
                401, "Invalid or missing API key", headers={"WWW-Authenticate": "Bearer"}
            )
            await unknown(scope, receive, send)
            return
        try:
            ticket = self.tenants.admit(state, admin_route)
        except Rejection as r:
            await error_response(r.status, r.message, headers=r.headers())(scope, receive, send)
            return
        scope.setdefault("state", {})["tenant"] = ticket
        status = 500

        async def send_with_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_with_status)
        finally:
            self.tenants.release(ticket, status)


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int, body_timeout: float) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and (
            not _DIGITS.fullmatch(declared) or int(declared) > self.max_body_bytes
        ):
            await self._reject(declared, scope, receive, send)
            return
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.body_timeout):
                while True:
                    message = await receive()
                    if message["type"] != "http.request":
                        return  # the client left before sending its body
                    chunks.append(message.get("body", b""))
                    size += len(chunks[-1])
                    if size > self.max_body_bytes:
                        await self._reject(str(size), scope, receive, send)
                        return
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            late = f"the request body was not received within {self.body_timeout:g} s"
            await error_response(408, late, headers={"Connection": "close"})(scope, receive, send)
            return
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        await self.app(scope, _replay(body, receive), send)

    async def _reject(self, declared: str, scope: Scope, receive: Receive, send: Send) -> None:
        if _DIGITS.fullmatch(declared):
            message, status = f"request body is larger than {self.max_body_bytes} bytes", 413
        else:
            message, status = "invalid Content-Length header", 400
        await error_response(status, message)(scope, receive, send)


def _replay(body: bytes, receive: Receive) -> Receive:
    """The buffered body once, then the real channel (where disconnects arrive)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay
