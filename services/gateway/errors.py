"""OpenAI-style error bodies and the handlers that turn framework errors into them.

Every error the gateway returns has the body
`{"error": {"message": str, "type": str, "param": str | None, "code": int}}` (vLLM's shape:
`type` names the HTTP class, `code` repeats the status).
"""

from __future__ import annotations

import json
import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from shared.sampling_params import SamplingParamsError

logger = logging.getLogger(__name__)

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "RequestEntityTooLargeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}
RETRY_AFTER_SECONDS = 1


class APIError(Exception):
    """An error meant for the API client, with its HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    error_type = _ERROR_TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    return {"error": {"message": message, "type": error_type, "param": param, "code": status}}


def error_response(
    status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
) -> Response:
    """A JSON error response; ASCII-escaped so that any echoed client text always encodes."""
    headers = dict(headers or {})
    if status in (429, 503):
        headers.setdefault("Retry-After", str(RETRY_AFTER_SECONDS))
    content = json.dumps(error_body(status, message, param), ensure_ascii=True)
    return Response(content, status_code=status, headers=headers, media_type="application/json")


_LOCATIONS = frozenset({"body", "query", "path", "header"})
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none"})


def _is_field(part: str) -> bool:
    """Pydantic names union members in error locations (`list[int]`, `str`, a model name)."""
    return not (
        part in _TYPE_TAGS or "[" in part or part.startswith("function-") or part[:1].isupper()
    )


def validation_param(loc: tuple[Any, ...] | list[Any]) -> str | None:
    """`("body", "messages", 0, "role")` → `"messages.0.role"`."""
    parts = [str(p) for p in loc if p not in _LOCATIONS]
    return ".".join(p for p in parts if _is_field(p)) or None


def _validation_message(error: dict[str, Any]) -> str:
    param = validation_param(error.get("loc", ()))
    message = str(error.get("msg", "invalid value"))
    return f"{param}: {message}" if param else message


def install_error_handlers(app: FastAPI) -> None:
    """Map API, sampling-parameter, validation and routing errors to OpenAI-style bodies
    (422 becomes 400)."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> Response:
        return error_response(exc.status, exc.message, exc.param)

    @app.exception_handler(SamplingParamsError)
    async def _sampling_error(_: Request, exc: SamplingParamsError) -> Response:
        return error_response(400, exc.message, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> Response:
        errors = list(exc.errors())
        first = errors[0] if errors else {}
        message = "; ".join(_validation_message(e) for e in errors[:5]) or "invalid request"
        return error_response(400, message, validation_param(first.get("loc", ())))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> Response:
        messages = {404: "Not Found", 405: "Method Not Allowed"}
        detail = exc.detail if isinstance(exc.detail, str) else messages.get(exc.status_code, "")
        return error_response(
            exc.status_code,
            detail or HTTPStatus(exc.status_code).phrase,
            headers=dict(exc.headers or {}),
        )
