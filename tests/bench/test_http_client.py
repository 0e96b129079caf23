"""bench/http_client.py against a small aiohttp server that closes each connection after its
stream: the chunks of each stream in turn (a line longer than aiohttp's default read buffer
among them, `[DONE]` left out) and an HTTP error raised."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from bench.http_client import client_session, sse_chunks

pytestmark = pytest.mark.unit

CHUNKS = [{"choices": [{"text": "a"}]}, {"choices": [{"text": "b" * 200_000}]}, {"usage": {}}]


async def stream(request: web.Request) -> web.StreamResponse:
    if (await request.json()).get("bad"):
        return web.json_response({"error": "bad"}, status=400)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    resp.force_close()  # as a server that keeps no connection alive after a stream
    await resp.prepare(request)
    for chunk in CHUNKS:
        await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
    await resp.write(b"data: [DONE]\n\n")
    return resp


async def served() -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/v1/completions", stream)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    (sock,) = site._server.sockets  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        await runner.cleanup()


def test_chunks_errors_and_closed_connections() -> None:
    async def run() -> None:
        async for url in served():
            async with client_session(timeout_s=30) as client:
                for _ in range(3):  # each on a fresh connection, the last one closed
                    async with client.post(f"{url}/v1/completions", json={}) as resp:
                        assert [c async for c in sse_chunks(resp)] == CHUNKS
                async with client.post(f"{url}/v1/completions", json={"bad": True}) as resp:
                    with pytest.raises(aiohttp.ClientResponseError, match="400"):
                        [c async for c in sse_chunks(resp)]

    asyncio.run(run())
