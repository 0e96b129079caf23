"""The CPU worker's reduced-precision weights served as a user runs them: a real stack (nats-server,
scheduler, gateway, a worker started with `cpu_weights` = `bf16_dot` or `q8_0`) and the
official `openai` client. Both formats' kernels give a row the same bits whatever batch it is
in, so eight concurrent requests, batched however the scheduler likes, get the tokens and
logprobs the in-process engine with the same format gives them one by one, bit for bit; and
they are not fp32's (the worker really converted its weights)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from openai import OpenAI

from bench.workload import QUESTIONS
from services.offline import LLM, SamplingParams

MODEL = "SmolLM2-135M-Instruct"
NEW_TOKENS = 16
TOP = 5
PROMPTS = QUESTIONS[:8]


@pytest.fixture(scope="module", params=["bf16_dot", "q8_0"])
def cpu_weights(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def served(launch_stack, smollm2_dir, cpu_weights):
    from services.worker.config import RunnerConfig

    runner = RunnerConfig(str(smollm2_dir), kv_cache_gib=0.25, cpu_weights=cpu_weights)
    stack = launch_stack(f"{cpu_weights}-stack", runner=runner)
    yield OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=120)
    stack.stop()


Generated = tuple[str, list[float], list[list[float]]]


def in_process(model_dir, cpu_weights: str) -> list[Generated]:
    """Each prompt alone in the offline engine: its text, the chosen tokens' logprobs and
    each position's top-5 logprobs (highest first)."""
    llm = LLM(model_dir, kv_cache_gib=0.25, cpu_weights=cpu_weights)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=TOP)
    results = []
    for prompt in PROMPTS:
        (out,) = llm.generate([prompt], params)
        lps = [entry for entry in out.outputs[0].logprobs if entry is not None]
        chosen = [entry.logprobs[0] for entry in lps]
        top = [sorted(entry.logprobs[1:], reverse=True) for entry in lps]
        results.append((out.outputs[0].text, chosen, top))
    llm.close()
    return results


def completion(client: OpenAI, prompt: str) -> Generated:
    got = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0, logprobs=TOP,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    choice = got.choices[0]
    assert choice.logprobs is not None and choice.logprobs.top_logprobs is not None
    top = [sorted(entry.values(), reverse=True) for entry in choice.logprobs.top_logprobs]
    return choice.text, list(choice.logprobs.token_logprobs or []), top


def test_concurrent_requests_get_the_in_process_engines_bits(
    served, smollm2_dir, cpu_weights, offline_llm
):
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(lambda p: completion(served, p), PROMPTS))
    expected = in_process(smollm2_dir, cpu_weights)
    for (text, chosen, top), (ref_text, ref_chosen, ref_top) in zip(got, expected, strict=True):
        assert text == ref_text
        assert chosen == ref_chosen
        assert top == ref_top
    fp32 = offline_llm.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
    )
    fp32_chosen = [[e.logprobs[0] for e in out.outputs[0].logprobs if e] for out in fp32]
    assert [chosen for _, chosen, _ in got] != fp32_chosen
