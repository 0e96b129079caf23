"""Token deltas go to the gateway that submitted each request, one batch per gateway."""

from __future__ import annotations

import asyncio

from services.scheduler.output_router import OutputRouter
from services.scheduler.request import FinishReason
from services.scheduler.scheduler import RequestOutput
from shared.subjects import Subjects
from shared.wire import OutputBatch
from tests.scheduler.fakes import FakePublisher


def test_one_batch_per_gateway_and_finished_requests_are_forgotten():
    publisher = FakePublisher()
    router = OutputRouter(publisher, Subjects("p"))
    router.add("a", "gw1")
    router.add("b", "gw2")
    router.add("c", "gw1")
    outputs = [
        RequestOutput("a", [1]),
        RequestOutput("b", [2], FinishReason.STOP, stop_token_id=2),
        RequestOutput("c", [3], FinishReason.LENGTH),
        RequestOutput("aborted", [4]),
    ]
    asyncio.run(router.publish(outputs))
    sent = {subject: msg for subject, msg in publisher.sent}
    assert set(sent) == {"p.out.gw1", "p.out.gw2"}
    gw1, gw2 = sent["p.out.gw1"], sent["p.out.gw2"]
    assert isinstance(gw1, OutputBatch) and isinstance(gw2, OutputBatch)
    assert [(d.req_id, d.new_token_ids, d.finish_reason) for d in gw1.deltas] == [
        ("a", [1], None),
        ("c", [3], "length"),
    ]
    assert gw2.deltas[0].stop_token_id == 2
    assert router.gateway_of == {"a": "gw1"}


def test_a_failed_request_ends_with_an_error_delta_and_is_forgotten():
    publisher = FakePublisher()
    router = OutputRouter(publisher, Subjects("p"))
    router.add("a", "gw1")
    asyncio.run(router.fail("a", "it hangs workers"))
    asyncio.run(router.fail("a", "again"))  # forgotten: nothing more is sent
    [(subject, batch)] = publisher.sent
    assert subject == "p.out.gw1" and isinstance(batch, OutputBatch)
    [delta] = batch.deltas
    assert (delta.req_id, delta.finish_reason, delta.error) == ("a", "error", "it hangs workers")
    assert router.gateway_of == {}
