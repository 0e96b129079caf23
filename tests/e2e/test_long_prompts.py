"""Prompts at the edge of the model's context through the served stack (the session `stack`:
default scheduler settings, chunked and paced prefill, a CPU worker with the C++ ops).

An 8,000-token prompt (SmolLM2 takes 8,192) comes back greedy-equal to transformers, and a
6,000-token prompt with 20 prompt logprobs per position completes with the worker's memory
bounded (its full logits would be 6,000 x 49,152 fp32 = 1.2 GB) and logprobs equal to
transformers' log-softmax. Both prompts are cut from one text, the shorter a prefix of the
longer, so one transformers forward pass serves both references.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from bench.long_prompts import corpus
from shared.tokenizer import Tokenizer

MODEL = "SmolLM2-135M-Instruct"
LONG = 8000
WITH_LOGPROBS = 6000
NEW_TOKENS = 8
NUM_PROMPT_LOGPROBS = 20
CHECKED_POSITIONS = [*range(1, 33), *range(2000, 2016), *range(WITH_LOGPROBS - 32, WITH_LOGPROBS)]
# The worker's peak RSS may grow by this much while it serves the prompt logprobs: room for
# chunks of logits, not for all of them.
MAX_PEAK_GROWTH_MB = 600
# A long prompt's prefill is the slowest legitimate request: on a slow 2-core machine 8,000
# tokens took over the shared client's 120 s (transformers' own forward over them took 4.5 min).
LONG_PROMPT_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def long_client(openai_client):
    return openai_client.with_options(timeout=LONG_PROMPT_TIMEOUT_S)


@pytest.fixture(scope="module")
def prompt_ids(smollm2_dir) -> list[int]:
    tokens = corpus(Tokenizer(smollm2_dir))
    return tokens[10_000 : 10_000 + LONG]


@pytest.fixture(scope="module")
def reference(smollm2_dir, prompt_ids) -> tuple[list[int], dict[int, torch.Tensor]]:
    """transformers, fp32: the greedy continuation of the long prompt, and the log-softmax of
    the next-token distribution at CHECKED_POSITIONS - 1 (predicting the token at each)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.model(torch.tensor([prompt_ids]), use_cache=True)
        hidden = out.last_hidden_state[0]  # [LONG, hidden_size]
        rows = torch.tensor([p - 1 for p in CHECKED_POSITIONS])
        logprobs = torch.log_softmax(model.lm_head(hidden[rows]), dim=-1)  # [positions, vocab]
        past, token = out.past_key_values, int(model.lm_head(hidden[-1]).argmax())
        greedy = [token]
        for _ in range(NEW_TOKENS - 1):
            step = model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
            past, token = step.past_key_values, int(step.logits[0, -1].argmax())
            greedy.append(token)
    return greedy, dict(zip(CHECKED_POSITIONS, logprobs, strict=True))


def test_an_8000_token_prompt_is_greedy_equal_to_transformers(
    long_client, smollm2_dir, prompt_ids, reference
):
    response = long_client.completions.create(
        model=MODEL,
        prompt=prompt_ids,
        max_tokens=NEW_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    greedy, _ = reference
    assert response.usage.prompt_tokens == LONG
    assert response.usage.completion_tokens == NEW_TOKENS
    assert response.choices[0].text == Tokenizer(smollm2_dir).decode(greedy)


def _peak_and_current_rss_mb(pid: int) -> tuple[float, float]:
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    return float(fields["VmHWM"].split()[0]) / 1024, float(fields["VmRSS"].split()[0]) / 1024


def test_6000_prompt_logprobs_complete_in_bounded_memory(long_client, stack, prompt_ids, reference):
    worker_pid = stack.procs["worker-0"].pid
    Path(f"/proc/{worker_pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
    _, rss_before = _peak_and_current_rss_mb(worker_pid)
    ids = prompt_ids[:WITH_LOGPROBS]
    response = long_client.completions.create(
        model=MODEL,
        prompt=ids,
        max_tokens=1,
        temperature=0,
        extra_body={"prompt_logprobs": NUM_PROMPT_LOGPROBS},
    )
    peak_after, _ = _peak_and_current_rss_mb(worker_pid)
    assert peak_after - rss_before < MAX_PEAK_GROWTH_MB, (rss_before, peak_after)

    prompt_logprobs = (response.choices[0].model_extra or {}).get("prompt_logprobs")
    assert prompt_logprobs is not None and len(prompt_logprobs) == WITH_LOGPROBS
    assert prompt_logprobs[0] is None
    for token_id, entry in zip(ids[1:], prompt_logprobs[1:], strict=True):
        assert str(token_id) in entry and len(entry) >= NUM_PROMPT_LOGPROBS
    _, expected = reference
    for position in CHECKED_POSITIONS:
        entry, ref = prompt_logprobs[position], expected[position]
        for token, value in entry.items():
            assert math.isclose(value["logprob"], float(ref[int(token)]), abs_tol=2e-3), (
                position,
                token,
            )
