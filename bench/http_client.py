"""The benchmarks' HTTP client: aiohttp, as vLLM's serving benchmark uses.

On a machine of a few cores the client shares them with the server it measures, and every CPU
millisecond it spends is taken from the model's threads. Streaming the reference workload at
32 requests in flight, httpx spent ~0.13 ms of CPU per streamed token, aiohttp (a C HTTP
parser) ~0.04 ms; the peers (llama-server) are measured through the same client.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

ClientSession = aiohttp.ClientSession
ClientError = aiohttp.ClientError  # what a failed request raises, with TimeoutError


def client_session(timeout_s: float | None = 600, max_connections: int = 256) -> ClientSession:
    """A session of at most `max_connections` connections, one per request: aiohttp does not
    check a kept-alive connection before reusing it, and a request sent on one the server has
    just closed fails ("Server disconnected": llama-server's first run after the warm-up
    stream, the gateway's after its 5 s keep-alive). A request, streamed to its end, fails after
    `timeout_s` seconds (None: never). Open it inside a running event loop."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=max_connections, force_close=True),
        timeout=aiohttp.ClientTimeout(total=timeout_s),
        read_bufsize=1 << 20,  # an event's line may be long (logprobs, long texts)
    )


async def sse_chunks(resp: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    """The JSON chunks of a streamed completion's server-sent events (an HTTP error raises)."""
    resp.raise_for_status()
    async for line in resp.content:
        if line.startswith(b"data: ") and line.rstrip() != b"data: [DONE]":
            yield json.loads(line[6:])
