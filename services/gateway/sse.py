"""Server-sent events, and noticing clients that leave.

`EventStreamResponse` watches the connection while it streams and closes its event generator
as soon as the client disconnects (whatever ASGI spec version the server speaks), so the
generator's cleanup aborts the engine requests at once. `run_until_disconnect` does the same
for non-streaming responses.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")

DONE = "data: [DONE]\n\n"
KEEPALIVE = ": keepalive\n\n"  # an SSE comment: clients skip it


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStreamResponse(StreamingResponse):
    def __init__(
        self,
        events: AsyncGenerator[str, None],
        on_close: Callable[[], None] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(
            events,
            200,
            {"Cache-Control": "no-cache", **(headers or {})},
            media_type="text/event-stream",
        )
        self.events = events
        self.on_close = on_close  # runs even if the client left before the first event

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def watch() -> None:
                    await wait_for_disconnect(receive)
                    group.cancel_scope.cancel()

                group.start_soon(watch)
                await self._stream(send)
                group.cancel_scope.cancel()
        finally:
            try:
                await self.events.aclose()  # the generator's cleanup aborts unfinished requests
            finally:
                if self.on_close is not None:
                    self.on_close()

    async def _stream(self, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        with contextlib.suppress(OSError):  # ASGI 2.4 servers raise on a closed connection
            async for event in self.events:
                await send(
                    {"type": "http.response.body", "body": event.encode(), "more_body": True}
                )
            await send({"type": "http.response.body", "body": b"", "more_body": False})


async def run_until_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """Await `work`, or cancel it and return None if the client disconnects first."""
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch_task.cancel()
        if not work_task.done():
            work_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work_task
    if work_task.cancelled():
        return None
    return work_task.result()
