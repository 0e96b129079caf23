"""uvicorn's httptools protocol (llhttp, in C) with a deadline on request headers.

uvicorn times out idle keep-alive connections but not a client that connects and sends nothing,
or sends its headers a byte at a time (slowloris): each such connection would be held forever.
Here every request's headers must be complete within `header_timeout` seconds of the
connection opening or of the first byte of the next request on it; otherwise the connection is
closed. (The body has its own deadline, `BodyLimitMiddleware`'s.)
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class HeaderDeadlineProtocol(HttpToolsProtocol):
    header_timeout = 10.0  # seconds; `with_header_timeout` makes a class with another value

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self.cycle is None or self.cycle.response_complete:
            self._arm()  # bytes of a new request: its headers are due
        cycle = self.cycle
        super().data_received(data)
        if self.cycle is not cycle:  # the headers are complete: a new request began
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._header_deadline is None:
            self._header_deadline = self.loop.call_later(self.header_timeout, self._expire)

    def _disarm(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _expire(self) -> None:
        self._header_deadline = None
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a request is being served
        if not self.transport.is_closing():
            self.logger.debug("closing a connection that sent no complete headers in time")
            self.transport.close()


def with_header_timeout(seconds: float) -> type[HeaderDeadlineProtocol]:
    """The protocol class for uvicorn's `http=` with this header deadline."""
    return type("HeaderDeadlineProtocol", (HeaderDeadlineProtocol,), {"header_timeout": seconds})
