"""Every wire message survives a MessagePack round trip with non-default values."""

from __future__ import annotations

import msgspec
import pytest

from shared.wire import (
    PROTOCOL_VERSION,
    AbortRequests,
    BatchPlan,
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    OutputBatch,
    SamplingParams,
    SchedulerHeartbeat,
    SubmitReply,
    SubmitRequest,
    TokenDelta,
    TokenLogprobs,
    WorkerHello,
    decoder,
    encode,
)

PARAMS = SamplingParams(
    n=2,
    temperature=0.7,
    top_p=0.9,
    top_k=40,
    min_p=0.05,
    seed=-3,
    max_tokens=None,
    min_tokens=2,
    stop_token_ids=[5, 6],
    ignore_eos=True,
    logprobs=3,
    prompt_logprobs=1,
    presence_penalty=0.5,
    frequency_penalty=-0.5,
    repetition_penalty=1.2,
    logit_bias={7: -100.0, 8: 2.5},
    allowed_token_ids=[1, 2, 3],
    bad_words_token_ids=[[4], [9, 10]],
    logprobs_mode="processed_logprobs",
)
LP = TokenLogprobs(token_ids=[3, 1], logprobs=[-0.25, -0.1], rank=2)

MESSAGES = [
    PARAMS,
    BatchPlan(
        step_id=9,
        new_reqs=[
            NewRequestData(
                req_id="a",
                prompt_token_ids=[1, 2],
                sampling_params=PARAMS,
                block_ids=[4],
                num_computed_tokens=16,
                output_token_ids=[3],
            )
        ],
        cached_reqs=[
            CachedRequestData(req_id="b", new_block_ids=[5], num_computed_tokens=33, resumed=True)
        ],
        num_scheduled_tokens={"a": 2, "b": 1},
        total_num_scheduled_tokens=3,
        finished_req_ids=["c"],
        preempted_req_ids=["d"],
        scheduler_epoch="e",
        worker_session="1",
    ),
    ModelRunnerOutput(
        step_id=9,
        worker_id="w",
        req_ids=["a", "b"],
        sampled_token_ids=[[7], []],
        logprobs=[LP, None],
        prompt_logprobs={"a": [None, LP]},
        execute_s=0.5,
    ),
    SubmitRequest(
        req_id="r",
        gateway_id="g",
        prompt_token_ids=[1],
        sampling_params=PARAMS,
        output_token_ids=[2, 3],
        priority=1,
    ),
    SubmitReply(accepted=False, status=429, message="full"),
    AbortRequests(req_ids=["x", "y"]),
    OutputBatch(
        deltas=[
            TokenDelta(
                req_id="r",
                new_token_ids=[4],
                finish_reason="stop",
                stop_token_id=4,
                num_cached_tokens=16,
                logprobs=[LP],
                prompt_logprobs=[None, LP],
            )
        ],
    ),
    SchedulerHeartbeat(
        epoch="e",
        num_ready_workers=2,
        model="m",
        max_model_len=2048,
        num_running=3,
        num_waiting=1,
        kv_cache_usage=0.5,
    ),
    WorkerHello(
        worker_id="w",
        instance_id="i",
        model="m",
        block_size=16,
        num_blocks=100,
        max_model_len=2048,
        max_num_seqs=64,
        device="cuda:0",
        vocab_size=49152,
        eos_token_ids=[2],
    ),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    data = encode(msg)
    assert decoder(type(msg)).decode(data) == msg


def test_messages_carry_the_protocol_version():
    plan = msgspec.msgpack.decode(encode(BatchPlan(step_id=1)))
    assert plan["version"] == PROTOCOL_VERSION


def test_wrong_types_are_rejected_not_misread():
    bad = msgspec.msgpack.encode({"step_id": "one"})
    with pytest.raises(msgspec.ValidationError):
        decoder(BatchPlan).decode(bad)
