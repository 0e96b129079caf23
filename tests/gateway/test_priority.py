"""Request `priority` (vLLM's extra field) reaches every engine request of both routes."""

from __future__ import annotations

import pytest

from services.gateway.engine_client import EngineError
from tests.gateway.fakes import CHAT, MODEL, MSG, C, sse_events


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("path", "fields"),
    [(C, {"prompt": ["a", "b"], "n": 2}), (CHAT, {"messages": MSG, "n": 2})],
)
@pytest.mark.parametrize("stream", [False, True])
async def test_priority_reaches_every_submit_request(client, engine, path, fields, stream):
    body = {"model": MODEL, "max_tokens": 2, "priority": -7, "stream": stream, **fields}
    r = await client.post(path, json=body)
    assert r.status_code == 200, r.text
    if stream:
        sse_events(r.text)
    assert len(engine.submitted) == (4 if path == C else 2)
    assert {s.priority for s in engine.submitted} == {-7}


@pytest.mark.anyio
@pytest.mark.parametrize(("path", "fields"), [(C, {"prompt": "a"}), (CHAT, {"messages": MSG})])
async def test_priority_defaults_to_zero(client, engine, path, fields):
    r = await client.post(path, json={"model": MODEL, "max_tokens": 2, **fields})
    assert r.status_code == 200, r.text
    assert [s.priority for s in engine.submitted] == [0]


@pytest.mark.anyio
@pytest.mark.parametrize("priority", [2**63, "high", 1.5])
async def test_priority_must_be_a_64_bit_integer(client, engine, priority):
    body = {"model": MODEL, "prompt": "a", "priority": priority}
    r = await client.post(C, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "priority"
    assert engine.submitted == []


@pytest.mark.anyio
async def test_a_rejected_priority_is_the_clients_error(client, engine):
    engine.reject = EngineError(400, "priority scheduling is not enabled")
    r = await client.post(C, json={"model": MODEL, "prompt": "a", "priority": 1})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "priority scheduling is not enabled"
