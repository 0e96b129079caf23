"""What one request may cost the gateway: text bounded by the context length before it is
tokenized, list sizes, SSE keepalive comments, the body deadline, and new requests waiting for
a scheduler shard (a scripted engine or transport, the real tokenizer)."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.gateway.inflight import InFlightRequests
from services.gateway.middleware import BodyLimitMiddleware
from services.gateway.prompt_encoder import SMALL_INPUT, longest_token_chars
from services.gateway.request_stream import EngineError
from shared.wire import SchedulerHeartbeat, SubmitReply
from tests.gateway.fakes import CHAT, MAX_MODEL_LEN, MODEL, C, FakeEngine, make_client
from tests.gateway.test_inflight import FakeTransport, _request

pytestmark = pytest.mark.anyio


@pytest.fixture
def limit(tokenizer) -> int:
    """The most characters a prompt may have: MAX_MODEL_LEN times the longest token."""
    return MAX_MODEL_LEN * longest_token_chars(tokenizer)


def test_the_longest_token_bounds_the_characters_per_token(tokenizer):
    longest = longest_token_chars(tokenizer)
    assert 16 <= longest <= 128
    text = "The quick brown fox jumps over the lazy dog. " * 200
    assert len(text) <= longest * len(tokenizer.encode(text))


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {"prompt": "x"}, "prompt"),
        (C, {"model": MODEL, "prompt": "x", "max_tokens": 1}, "prompt"),
        (C, {"model": MODEL, "prompt": ["a", "x"], "max_tokens": 1}, "prompt"),
        (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}, "messages"),
        ("/tokenize", {"messages": [{"role": "user", "content": "x"}]}, "messages"),
    ],
)
async def test_text_longer_than_the_context_can_hold_is_refused_untokenized(
    client, engine, limit, path, body, param
):
    big = "y" * (limit + 1)
    if "prompt" in body:
        prompts = body["prompt"]
        body = {**body, "prompt": [big] if isinstance(prompts, list) else big}
    else:
        half = {"role": "user", "content": big[: len(big) // 2 + 1]}
        body = {**body, "messages": [half, half]}  # the sum counts
    r = await client.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == 400
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in error["message"]
    assert "characters long" in error["message"]  # refused by length, not by tokens
    assert not engine.submitted


async def test_a_long_text_that_fits_is_tokenized_off_the_loop_exactly(client, tokenizer):
    text = "hello world " * (SMALL_INPUT // 10)  # longer than SMALL_INPUT: a thread encodes it
    r = await client.post("/tokenize", json={"prompt": text})
    assert r.status_code == 200
    assert r.json()["tokens"] == tokenizer.encode(text)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"stop": ["z" * 30_000]}, "stop"),
        ({"stop": ["z" * 15_000] * 2}, "stop"),
        ({"bad_words": ["z" * 30_000]}, "bad_words"),
        ({"logit_bias": {str(i): 1.0 for i in range(50_000)}}, "logit_bias"),
        ({"logit_bias": {"1" * 5000: 1.0}}, "logit_bias"),
        ({"stop_token_ids": [1] * 50_000}, "stop_token_ids"),
        ({"allowed_token_ids": [1] * 50_000}, "allowed_token_ids"),
    ],
)
async def test_oversized_sampling_lists_are_refused(client, engine, extra, param):
    for path, body in ((C, {"prompt": "hi"}), (CHAT, {"messages": [{"role": "user"}]})):
        r = await client.post(path, json={"model": MODEL, "max_tokens": 1, **body, **extra})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and len(error["message"]) < 300
    assert not engine.submitted


async def test_too_many_prompts_are_refused_before_tokenizing(client):
    r = await client.post(C, json={"model": MODEL, "prompt": ["hi"] * 129, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


async def test_token_lists_longer_than_the_context_are_refused(client):
    r = await client.post("/detokenize", json={"tokens": [1] * (SMALL_INPUT + 1)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    r = await client.post(C, json={"model": MODEL, "prompt": [1] * MAX_MODEL_LEN})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


async def test_a_stream_waiting_for_tokens_gets_keepalive_comments(tokenizer):
    engine = FakeEngine(tokenizer, text="Hi", delay=0.3)
    async with make_client(engine, tokenizer, keepalive_interval=0.05) as client:
        body = {"model": MODEL, "prompt": "hi", "stream": True, "max_tokens": 2}
        r = await client.post(C, json=body)
    events = r.text.split("\n\n")
    assert events.count(": keepalive") >= 4
    assert events[-2] == "data: [DONE]"
    first_data = next(i for i, e in enumerate(events) if e.startswith("data: "))
    assert events[:first_data] == [": keepalive"] * first_data  # waited for the first token


async def test_a_body_not_complete_in_time_gets_408():
    async def app(scope, receive, send):
        raise AssertionError("never reached")

    async def receive():
        await asyncio.sleep(0.05)
        return {"type": "http.request", "body": b"x", "more_body": True}  # forever

    sent = []

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "headers": [], "path": "/v1/completions"}
    started = time.monotonic()
    await BodyLimitMiddleware(app, max_body_bytes=10**6, body_timeout=0.3)(scope, receive, send)
    assert 0.3 <= time.monotonic() - started < 2
    assert sent[0]["status"] == 408
    assert (b"connection", b"close") in sent[0]["headers"]


def _beat(**fields) -> SchedulerHeartbeat:
    return SchedulerHeartbeat(epoch="e2", num_ready_workers=1, **fields)


async def test_a_new_request_waits_for_a_shard_to_become_available():
    transport = FakeTransport(1)
    transport.shards[0].last_heartbeat -= 60  # silent: unavailable
    requests = InFlightRequests(transport, orphan_timeout=60.0, resubmit_timeout=5.0)
    submitting = asyncio.ensure_future(requests.submit(_request("a")))
    await asyncio.sleep(0.2)
    assert not submitting.done() and not transport.submits
    transport.shards.heartbeat(0, _beat())
    await asyncio.wait_for(submitting, 1)
    assert transport.submits == [(0, "a")]


async def test_a_new_request_fails_after_the_timeout_without_a_shard():
    transport = FakeTransport(1)
    transport.shards.heartbeat(0, _beat(leaving=True))  # fresh but leaving: unavailable
    assert not transport.shards.ready
    requests = InFlightRequests(transport, orphan_timeout=60.0, resubmit_timeout=0.3)
    started = time.monotonic()
    with pytest.raises(EngineError) as err:
        await requests.submit(_request("a"))
    assert err.value.status == 503 and 0.3 <= time.monotonic() - started < 2
    assert not transport.submits and len(requests) == 0


async def test_a_shard_answering_503_is_retried_after_the_next_heartbeat():
    transport = FakeTransport(1)
    transport.replies[0] = SubmitReply(accepted=False, status=503, message="not ready")
    requests = InFlightRequests(transport, orphan_timeout=60.0, resubmit_timeout=5.0)
    submitting = asyncio.ensure_future(requests.submit(_request("a")))
    await asyncio.sleep(0.2)
    assert transport.submits == [(0, "a")]  # no busy loop while waiting
    transport.replies[0] = SubmitReply(accepted=True)
    transport.shards.heartbeat(0, _beat())
    await asyncio.wait_for(submitting, 1)
    assert transport.submits == [(0, "a"), (0, "a")]
