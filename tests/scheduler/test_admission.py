"""Admission replies: readiness, queue limit, duplicates and the shared parameter rules."""

from __future__ import annotations

from typing import Any

import pytest

from services.scheduler.admission import Admission
from services.scheduler.placement import Placement
from services.scheduler.request import Request
from services.scheduler.worker_pool import WorkerPool
from shared.config import SchedulerConfig
from shared.sampling_params import SamplingParams
from shared.wire import SubmitReply, SubmitRequest
from tests.scheduler.fakes import make_hello


def submit(req_id: str = "r", prompt: list[int] | None = None, **params: Any) -> SubmitRequest:
    return SubmitRequest(
        req_id=req_id,
        gateway_id="gw",
        prompt_token_ids=[1, 2, 3] if prompt is None else prompt,
        sampling_params=SamplingParams(**params),
    )


@pytest.fixture
def admission() -> Admission:
    pool = WorkerPool(SchedulerConfig())
    pool.register(make_hello(max_model_len=64, vocab_size=100))
    return Admission(pool, Placement(pool, wake=lambda _: None), max_waiting=2)


def test_accepts_a_valid_request(admission):
    assert admission.check(submit()) == SubmitReply(accepted=True)


def test_refuses_while_leaving_or_without_healthy_workers(admission):
    admission.leaving = True
    assert admission.check(submit()).status == 503
    empty = WorkerPool(SchedulerConfig())
    reply = Admission(empty, Placement(empty, lambda _: None), 8).check(submit())
    assert (reply.accepted, reply.status, reply.message) == (False, 503, "no worker is ready")
    admission.leaving = False
    admission.pool.workers["w0"].healthy = False  # missed a step deadline
    assert admission.check(submit()).message == "no worker is ready"


def test_queue_limit_and_duplicates(admission):
    admission.placement.place(Request("a", [1, 2], SamplingParams()))
    assert admission.check(submit("a")).message == "duplicate request id"
    admission.placement.place(Request("b", [1, 2], SamplingParams()))
    assert admission.check(submit("c")).status == 429


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"temperature": 5.0}, "temperature: temperature must be in [0, 2], got 5.0."),
        ({"logit_bias": {100: 1.0}}, "logit_bias: token_id(s) [100] in logit_bias contain"),
        ({"max_tokens": 0}, "max_tokens: max_tokens must be at least 1, got 0."),
    ],
)
def test_sampling_params_follow_the_shared_rules(admission, params, message):
    reply = admission.check(submit(**params))
    assert (reply.accepted, reply.status) == (False, 400)
    assert reply.message.startswith(message)


def test_context_length_and_empty_prompt(admission):
    reply = admission.check(submit(prompt=list(range(64))))
    assert reply.status == 400
    assert reply.message == (
        "This model's maximum context length is 64 tokens. However, your request has 64 input "
        "tokens. Please reduce the length of the input messages."
    )
    continuation = submit(prompt=list(range(40)))
    continuation.output_token_ids = list(range(30))  # streamed tokens count as context
    assert "has 70 input tokens" in admission.check(continuation).message
    reply = admission.check(submit(prompt=[]))
    assert (reply.status, reply.message) == (400, "The decoder prompt cannot be empty")
