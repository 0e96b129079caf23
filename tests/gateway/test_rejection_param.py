"""A scheduler's rejection that names the request field at fault reaches the client's error
body as its `param`."""

from __future__ import annotations

import pytest

from services.gateway.engine_client import EngineError
from shared.wire import SubmitReply
from tests.gateway.fakes import MODEL, C
from tests.gateway.test_inflight import FakeTransport, _inflight, _request

pytestmark = pytest.mark.anyio

MESSAGE = "Got priority 1 but Priority scheduling is not enabled."


async def test_a_rejected_submit_keeps_its_param():
    transport = FakeTransport(1)
    transport.replies[0] = SubmitReply(
        accepted=False, status=400, message=MESSAGE, param="priority"
    )
    with pytest.raises(EngineError) as err:
        await _inflight(transport).submit(_request("a"))
    assert (err.value.status, err.value.message, err.value.param) == (400, MESSAGE, "priority")


async def test_the_client_gets_the_param(client, engine):
    engine.reject = EngineError(400, MESSAGE, "priority")
    r = await client.post(C, json={"model": MODEL, "prompt": "a", "priority": 1})
    assert r.status_code == 400
    assert r.json()["error"] == {
        "message": MESSAGE,
        "type": "BadRequestError",
        "param": "priority",
        "code": 400,
    }
