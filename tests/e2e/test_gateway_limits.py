"""No single request, client or stuck process hurts the others, through the real gateway process
of a stack with a simulated worker: a 30 MB prompt is refused before it is tokenized (the
gateway's peak RSS is measured) while a normal request is served; streams that wait for tokens
get keepalive comments; a scheduler that dies fails its streams within the scheduler timeout
and /health within the heartbeat timeout; a new request sent while the scheduler restarts waits
for it; slowloris connections are cut; the drain timeout ends streams with one log line."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from services.gateway.config import GatewayConfig
from services.launcher import Stack

MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 2048
SCHEDULER_TIMEOUT = 6.0
HEARTBEAT_TIMEOUT = GatewayConfig.heartbeat_timeout
KEEPALIVE = 0.3
HEADER_TIMEOUT = BODY_TIMEOUT = 2.0
DRAIN_TIMEOUT = 1.0
BIG = 30_000_000  # characters of the big prompt (a 30 MB body)
LONG = {"max_tokens": 1900, "extra_body": {"ignore_eos": True}}  # seconds of simulated steps


@pytest.fixture(scope="module")
def stack(launch_stack):
    settings = {
        "SKIFF_SCHEDULER_TIMEOUT": SCHEDULER_TIMEOUT,
        "SKIFF_KEEPALIVE_INTERVAL": KEEPALIVE,
        "SKIFF_HEADER_TIMEOUT": HEADER_TIMEOUT,
        "SKIFF_BODY_TIMEOUT": BODY_TIMEOUT,
        "SKIFF_DRAIN_TIMEOUT": DRAIN_TIMEOUT,
    }
    with pytest.MonkeyPatch.context() as env:  # the gateway reads them at start
        for name, value in settings.items():
            env.setenv(name, str(value))
        s = launch_stack("gateway-limits", device="sim", workers=1)
        yield s
        s.stop()


@pytest.fixture(scope="module")
def client(stack) -> OpenAI:
    return OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=60)


def _memory_kb(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0])
    return fields


def _timed_completion(client: OpenAI) -> float:
    started = time.monotonic()
    out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4)
    assert out.choices[0].finish_reason == "length"
    return time.monotonic() - started


def test_a_30mb_prompt_is_refused_before_tokenizing_within_bounded_memory(stack, client):
    """Bound: the gateway's peak RSS grows by at most 8x the body (240 MB); before, tokenizing
    it took the gateway to 4.45 GB and stalled other requests for ~20 s."""
    _timed_completion(client)  # warm
    pid = stack.procs["gateway"].pid
    before = _memory_kb(pid)
    text = "All work and no play makes Jack a dull boy. " * (BIG // 44)
    bodies = {
        "/tokenize": {"prompt": text},
        "/v1/completions": {"model": MODEL, "prompt": text, "max_tokens": 4},
        "/v1/chat/completions": {
            "model": MODEL,
            "messages": [{"role": "user", "content": text[: BIG // 2]}] * 2,
        },
    }
    latencies: list[float] = []
    for path, body in bodies.items():
        payload = json.dumps(body).encode()
        assert len(payload) > 0.99 * BIG
        answers: list[httpx.Response] = []
        sender = threading.Thread(target=_post, args=(f"{stack.url}{path}", payload, answers))
        sender.start()
        while sender.is_alive():
            latencies.append(_timed_completion(client))
        sender.join()
        (answer,) = answers
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["code"] == 400 and "maximum context length is 2048" in error["message"]
        assert error["param"] == ("messages" if "chat" in path else "prompt")
    after = _memory_kb(pid)
    growth_mb = (after["VmHWM"] - before["VmRSS"]) / 1024
    print(
        f"gateway RSS {before['VmRSS'] / 1024:.0f} MB, peak {after['VmHWM'] / 1024:.0f} MB "
        f"(+{growth_mb:.0f} MB for a {BIG / 1e6:.0f} MB body); "
        f"concurrent completions took at most {max(latencies):.2f} s"
    )
    assert growth_mb < 8 * BIG / 1e6
    assert latencies and max(latencies) < 3.0
    # a long prompt that fits is tokenized (in a thread), as /tokenize counts it
    prompt = "hello world " * 800  # 9600 characters, about 1600 tokens
    count = httpx.post(f"{stack.url}/tokenize", json={"prompt": prompt}).json()["count"]
    fits = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
    assert fits.usage.prompt_tokens == count > 1000


def _post(url: str, payload: bytes, answers: list[httpx.Response]) -> None:
    headers = {"Content-Type": "application/json"}
    answers.append(httpx.post(url, content=payload, headers=headers, timeout=120))


def _sse_lines(stack: Stack, body: dict, seen: list[str]) -> None:
    """Stream a completion, collecting every SSE line (comments included) into `seen`."""
    with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line:
                seen.append(line)


def test_a_stream_that_waits_for_tokens_gets_keepalive_comments(stack, client):
    lines: list[str] = []
    body = {"model": MODEL, "prompt": "Hello", "stream": True, "max_tokens": 40}
    workers = stack.procs["sim-workers"]
    workers.send_signal(signal.SIGSTOP)  # the worker is stuck: no tokens for 2 s
    try:
        reader = threading.Thread(target=_sse_lines, args=(stack, body, lines))
        reader.start()
        time.sleep(2.0)
    finally:
        workers.send_signal(signal.SIGCONT)
    reader.join(60)
    keepalives = [line for line in lines if line == ": keepalive"]
    assert len(keepalives) >= 3, lines[:10]
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert events[-1]["choices"][0]["finish_reason"] == "length" and lines[-1] == "data: [DONE]"
    # the official client skips the comments
    text = "".join(
        c.choices[0].text
        for c in client.completions.create(model=MODEL, prompt="Hi", max_tokens=8, stream=True)
    )
    assert text


def _health(stack: Stack) -> int:
    return httpx.get(f"{stack.url}/health", timeout=5).status_code


def test_a_dead_scheduler_fails_streams_within_the_scheduler_timeout(stack, client):
    stream = client.completions.create(model=MODEL, prompt="Hello", stream=True, **LONG)
    next(iter(stream))
    stack.kill("scheduler", signal.SIGKILL)  # and nobody restarts it
    killed = time.monotonic()
    health_503 = None
    while health_503 is None and time.monotonic() - killed < 10:
        if _health(stack) == 503:
            health_503 = time.monotonic() - killed
        time.sleep(0.1)
    error = None
    try:
        for _chunk in stream:
            pass
    except Exception as e:  # the openai client raises the stream's error event
        error = e
    failed = time.monotonic() - killed
    print(f"/health 503 after {health_503} s, stream failed after {failed:.1f} s")
    assert health_503 is not None and health_503 < HEARTBEAT_TIMEOUT + 1.5
    assert error is not None and "lost contact with the scheduler" in str(error)
    assert SCHEDULER_TIMEOUT - 1 < failed < SCHEDULER_TIMEOUT + 3
    stack.start_scheduler()
    stack.wait_ready(60)


def test_a_new_request_waits_for_a_restarting_scheduler(stack, client):
    stack.kill("scheduler", signal.SIGKILL)
    sent = time.monotonic()
    answers: list[object] = []

    def complete() -> None:
        try:
            answers.append(client.completions.create(model=MODEL, prompt="Hi", max_tokens=4))
        except Exception as e:  # recorded for the assertion below
            answers.append(e)

    requester = threading.Thread(target=complete)
    requester.start()
    time.sleep(1.0)
    assert not answers, answers  # waiting, not failed at once
    stack.start_scheduler()
    requester.join(SCHEDULER_TIMEOUT + 30)
    (answer,) = answers
    assert not isinstance(answer, Exception), answer
    assert answer.choices[0].finish_reason == "length"  # type: ignore[attr-defined]
    print(f"served {time.monotonic() - sent:.1f} s after the scheduler was killed")
    stack.wait_ready(60)


def test_a_graceful_scheduler_handover_delays_requests_instead_of_failing_them(stack, client):
    """SIGTERM: the scheduler's last heartbeat says it is leaving; the gateway stops sending it
    new requests at once and moves its streams to the next scheduler, started right after."""
    stream = client.completions.create(
        model=MODEL, prompt="Hello", stream=True, stream_options={"include_usage": True}, **LONG
    )
    next(iter(stream))
    scheduler = stack.procs["scheduler"]
    scheduler.send_signal(signal.SIGTERM)
    stopped = time.monotonic()
    assert scheduler.wait(SCHEDULER_TIMEOUT) == 0
    print(f"the scheduler left in {time.monotonic() - stopped:.1f} s")
    assert _health(stack) == 503  # unavailable at once, not after the heartbeat timeout
    answers: list[object] = []
    requester = threading.Thread(
        target=lambda: answers.append(
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=4)
        )
    )
    requester.start()
    stack.start_scheduler()
    chunks = list(stream)
    requester.join(SCHEDULER_TIMEOUT + 30)
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == LONG["max_tokens"]  # every token, once
    (answer,) = answers
    assert answer.choices[0].finish_reason == "length"  # type: ignore[attr-defined]
    stack.wait_ready(60)


def _closed_within(sock: socket.socket, seconds: float) -> tuple[bool, bytes]:
    """Whether the server closed `sock` within `seconds`, and what it sent first."""
    sock.settimeout(seconds)
    received = b""
    try:
        while chunk := sock.recv(4096):
            received += chunk
    except TimeoutError:
        return False, received
    except ConnectionResetError:
        pass
    return True, received


def test_slowloris_connections_are_cut(stack, client):
    host, port = stack.url.removeprefix("http://").split(":")
    idle = socket.create_connection((host, int(port)))
    trickle_headers = socket.create_connection((host, int(port)))
    trickle_body = socket.create_connection((host, int(port)))
    started = time.monotonic()
    trickle_body.sendall(
        b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000\r\n\r\n{"
    )
    headers = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    for i, byte in enumerate(headers[:6]):  # one byte every 0.5 s: never complete in time
        with contextlib.suppress(ConnectionError):  # cut already
            trickle_headers.sendall(bytes([byte]))
        if i < 2:  # (sending after the cut would reset the 408 away)
            trickle_body.sendall(b" ")
        time.sleep(0.5)
    assert _timed_completion(client) < 3.0  # meanwhile, others are served
    for sock, name in ((idle, "idle"), (trickle_headers, "headers")):
        closed, received = _closed_within(sock, HEADER_TIMEOUT + 3)
        assert closed and received == b"", name
    closed, received = _closed_within(trickle_body, BODY_TIMEOUT + 3)
    assert closed and received.startswith(b"HTTP/1.1 408"), received
    assert b'"code":408' in received.replace(b" ", b"")
    assert time.monotonic() - started < max(HEADER_TIMEOUT, BODY_TIMEOUT) + 4
    for sock in (idle, trickle_headers, trickle_body):
        sock.close()


def test_the_drain_timeout_ends_streams_with_one_log_line(stack, client):
    """Last: the gateway exits."""
    streams = [
        client.completions.create(model=MODEL, prompt=f"Hello {i}", stream=True, **LONG)
        for i in range(4)
    ]
    for stream in streams:
        next(iter(stream))
    stack.procs["gateway"].send_signal(signal.SIGTERM)
    errors = []
    for stream in streams:
        try:
            for _chunk in stream:
                pass
        except Exception as e:  # the error event
            errors.append(str(e))
    assert len(errors) == 4 and all("shutting down" in e for e in errors), errors
    assert stack.procs["gateway"].wait(30) == 0
    log = (Path(stack.config.log_dir) / "gateway.log").read_text()
    assert log.count("drain timeout") == 1 and "Traceback" not in log, log[-3000:]
