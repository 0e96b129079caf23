"""Messages over the NATS payload limit cross the real stack in parts and arrive whole.

A stack of its own whose nats-server allows 64 KiB per message streams a request with 20 prompt
logprobs over a ~600-token prompt: the worker's `ModelRunnerOutput` and the scheduler's
`OutputBatch` carrying them are over twice the limit, so both are split and reassembled.
"""

from __future__ import annotations

import math

import pytest
from openai import OpenAI

from services.offline import SamplingParams
from shared.tokenizer import Tokenizer
from shared.wire import OutputBatch, TokenDelta, TokenLogprobs, encode

MODEL = "SmolLM2-135M-Instruct"
MAX_PAYLOAD = 64 * 1024
NUM_PROMPT_LOGPROBS = 20
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def small_payload_stack(launch_stack):
    s = launch_stack("large-output", nats_max_payload=MAX_PAYLOAD)
    yield s
    s.stop()


def _prompt_ids(smollm2_dir) -> list[int]:
    text = " ".join(f"Item {i}: the {i}th line of a long numbered list." for i in range(36))
    ids = Tokenizer(smollm2_dir).encode(text, add_special_tokens=False)
    assert 500 < len(ids) < 1000
    return ids


def _as_wire(entry: dict | None) -> TokenLogprobs | None:
    """A response's prompt-logprobs entry back as the wire struct (to size the wire message)."""
    if entry is None:
        return None
    logprobs = [v["logprob"] for v in entry.values()]
    return TokenLogprobs(token_ids=[int(k) for k in entry], logprobs=logprobs, rank=1)


def test_output_batch_over_the_payload_limit_arrives_whole(
    small_payload_stack, smollm2_dir, offline_llm
):
    prompt_ids = _prompt_ids(smollm2_dir)
    client = OpenAI(
        base_url=f"{small_payload_stack.url}/v1", api_key="unused", max_retries=0, timeout=60
    )
    stream = client.completions.create(
        model=MODEL,
        prompt=prompt_ids,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        extra_body={"prompt_logprobs": NUM_PROMPT_LOGPROBS, "ignore_eos": True},
    )
    chunks = [chunk.choices[0] for chunk in stream if chunk.choices]
    prompt_logprobs = (chunks[0].model_extra or {}).get("prompt_logprobs")
    text = "".join(c.text for c in chunks)
    assert chunks[-1].finish_reason == "length"

    assert prompt_logprobs is not None and len(prompt_logprobs) == len(prompt_ids)
    assert prompt_logprobs[0] is None
    for token_id, entry in zip(prompt_ids[1:], prompt_logprobs[1:], strict=True):
        assert str(token_id) in entry and len(entry) >= NUM_PROMPT_LOGPROBS
        assert all(math.isfinite(v["logprob"]) for v in entry.values())
    delta = TokenDelta(req_id="r", prompt_logprobs=[_as_wire(e) for e in prompt_logprobs])
    assert len(encode(OutputBatch(deltas=[delta]))) > 2 * MAX_PAYLOAD  # it crossed in parts

    ref = offline_llm.generate(
        [prompt_ids],
        SamplingParams(
            temperature=0,
            max_tokens=MAX_TOKENS,
            ignore_eos=True,
            prompt_logprobs=NUM_PROMPT_LOGPROBS,
        ),
    )[0]
    assert text == ref.outputs[0].text
    assert ref.prompt_logprobs is not None
    for token_id, entry, expected in zip(
        prompt_ids[1:], prompt_logprobs[1:], ref.prompt_logprobs[1:], strict=True
    ):
        assert expected is not None
        assert entry[str(token_id)]["logprob"] == pytest.approx(expected.logprobs[0], abs=1e-3)
