"""A client that goes away aborts its engine requests."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import pytest

from services.gateway.app import create_app
from tests.gateway.fakes import CHAT, MSG, C, FakeEngine, gateway_config

# ---- client disconnects --------------------------------------------------------------------


async def _call_and_disconnect(app, path: str, body: dict, after: Callable[[list], bool]):
    """Drive the ASGI app directly; disconnect once `after(sent_messages)` holds."""
    sent: list[dict] = []
    disconnect = asyncio.Event()
    request_sent = False

    async def receive() -> dict:
        nonlocal request_sent
        if not request_sent:
            request_sent = True
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)
        if after(sent):
            disconnect.set()

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"host", b"test")],
        "client": ("127.0.0.1", 1),
        "server": ("test", 80),
    }
    task = asyncio.create_task(app(scope, receive, send))
    return task, disconnect, sent


@pytest.mark.anyio
async def test_stream_disconnect_aborts(tokenizer):
    engine = FakeEngine(tokenizer, text="one two three four five six seven eight", delay=0.02)
    app = create_app(engine, tokenizer, gateway_config())
    body = {"prompt": "x", "stream": True, "n": 2, "max_tokens": 100}
    task, _, sent = await _call_and_disconnect(app, C, body, lambda s: len(s) >= 3)
    await asyncio.wait_for(task, 5)
    await asyncio.sleep(0.05)
    assert sorted(engine.aborted) == sorted(r.req_id for r in engine.submitted)
    assert len(engine.submitted) == 2
    assert not any(m.get("more_body") is False for m in sent[1:])  # stream was cut short


@pytest.mark.anyio
async def test_non_stream_disconnect_aborts(tokenizer):
    engine = FakeEngine(tokenizer, delay=0.05)
    app = create_app(engine, tokenizer, gateway_config())
    task, disconnect, _ = await _call_and_disconnect(
        app, CHAT, {"messages": MSG, "max_tokens": 100}, lambda s: False
    )
    await asyncio.sleep(0.1)
    assert engine.submitted and not engine.aborted
    disconnect.set()
    await asyncio.wait_for(task, 5)
    await asyncio.sleep(0.05)
    assert engine.aborted == [engine.submitted[0].req_id]
