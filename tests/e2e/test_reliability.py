"""Failures a client must not notice: the scheduler restarts, NATS restarts. The client's
stream goes on and ends with exactly the tokens an undisturbed run gives, with async scheduling
on and off."""

from __future__ import annotations

import signal
import threading
import time

import pytest
from openai import OpenAI

from services.launcher import Stack
from services.offline import SamplingParams

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "Tell me about the history of the bicycle."
MAX_TOKENS = 120


@pytest.fixture(scope="module", params=["async", "sync"])
def own_stack(request, launch_stack):
    """Async scheduling (the default) on a stack of its own; sync on the shared sync stack."""
    if request.param == "sync":
        yield request.getfixturevalue("sync_stack")
        return
    s = launch_stack("reliability")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def expected(offline_llm) -> str:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return offline_llm.generate([PROMPT], params)[0].outputs[0].text


def stream_with_disruption(stack: Stack, disrupt, after_chunks: int = 10) -> tuple[str, str]:
    client = OpenAI(base_url=f"{stack.url}/v1", api_key="x", max_retries=0, timeout=300)
    stream = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    text, finish, worker = "", None, None
    for i, chunk in enumerate(stream):
        if i == after_chunks:
            worker = threading.Thread(target=disrupt)
            worker.start()
        if chunk.choices:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
    if worker is not None:
        worker.join()
    return text, finish


def test_scheduler_restart_mid_stream(own_stack, expected):
    def restart():
        own_stack.kill("scheduler", signal.SIGKILL)
        own_stack.start_scheduler()

    text, finish = stream_with_disruption(own_stack, restart)
    assert finish == "length"
    assert text == expected
    own_stack.wait_ready(60)


def test_nats_restart_mid_stream(own_stack, expected):
    def restart():
        own_stack.kill("nats", signal.SIGKILL)
        time.sleep(0.5)
        own_stack.start_nats()

    text, finish = stream_with_disruption(own_stack, restart)
    assert finish == "length"
    assert text == expected
    own_stack.wait_ready(60)
