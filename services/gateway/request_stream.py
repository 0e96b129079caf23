"""What the HTTP layer gets back from the engine: a request's token stream, or an error."""

from __future__ import annotations

import asyncio

from shared.wire import TokenDelta


class EngineError(Exception):
    """The engine refused or lost a request; `status` is the HTTP status for the client,
    `param` the request field at fault, if one is."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


class RequestStream:
    """Token deltas of one request in arrival order; iteration ends after the finishing delta.

    Iterating raises `EngineError` if the engine lost the request.
    """

    def __init__(self, req_id: str) -> None:
        self.req_id = req_id
        self.finished = False
        self._queue: asyncio.Queue[TokenDelta | EngineError] = asyncio.Queue()

    def put(self, delta: TokenDelta) -> None:
        self._queue.put_nowait(delta)

    def fail(self, error: EngineError) -> None:
        self._queue.put_nowait(error)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> TokenDelta:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, EngineError):
            self.finished = True
            raise item
        self.finished = item.finish_reason is not None
        return item
