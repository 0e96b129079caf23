"""Prefill/decode disaggregation on a real stack: one prefill and one decode CPU worker. Long
prompts are prefilled on the prefill worker, their KV moves to the decode worker over the
KV-transfer path, and the answers (greedy, and seeded sampling) equal the colocated ones token
for token, through the official OpenAI client; short prompts stay on the decode worker. A
prefill worker killed as its first token streams loses nothing."""

from __future__ import annotations

import random
import re
import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from openai import OpenAI

from shared.sampling_params import SamplingParams

MODEL = "SmolLM2-135M-Instruct"
THRESHOLD = 128  # uncached prompt tokens above which a prompt is disaggregated


@pytest.fixture(scope="module")
def pd_stack(launch_stack):
    from services.launcher import free_port
    from shared.config import SchedulerConfig

    s = launch_stack(
        "pd-stack",
        prefill_workers=1,
        decode_workers=1,
        scheduler=SchedulerConfig(max_model_len=4096, disaggregation_threshold=THRESHOLD),
        scheduler_metrics_port=free_port(),
    )
    wait_for_both_workers(s)
    yield s
    s.stop()


def wait_for_both_workers(stack, timeout_s: float = 600.0) -> None:
    """The stack is up once one worker is ready; a request placed before the prefill worker
    is would not be disaggregated."""
    url = f"http://127.0.0.1:{stack.config.scheduler_metrics_port}/metrics"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        ready = re.search(r"^skiff_workers_ready (\S+)$", text, re.M)
        if ready and float(ready.group(1)) == 2:
            return
        time.sleep(0.5)
    raise TimeoutError(f"the prefill and decode workers were not both ready in {timeout_s} s")


def client_of(stack) -> OpenAI:
    return OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=600)


def metrics(stack) -> dict[str, float]:
    """The scheduler's skiff_pd_* series, by name with labels."""
    url = f"http://127.0.0.1:{stack.config.scheduler_metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {
        name: float(value)
        for name, value in re.findall(r"^(skiff_pd_\S+) (\S+)$", text, re.M)
        if not name.endswith("_created")
    }


def random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 20000) for _ in range(n)]


def complete(stack, prompt: list[int], **kw) -> str:
    out = client_of(stack).completions.create(
        model=MODEL, prompt=prompt, extra_body={"ignore_eos": True}, **kw
    )
    return out.choices[0].text


def test_greedy_answers_equal_the_engine(pd_stack, offline_llm):
    rng = random.Random(3)
    long = [random_prompt(rng, n) for n in (1500, 400, 300, 200)]
    short = [random_prompt(rng, n) for n in (20, 60)]
    prompts = long + short
    before = metrics(pd_stack)
    with ThreadPoolExecutor(len(prompts)) as pool:
        served = list(
            pool.map(lambda p: complete(pd_stack, p, max_tokens=12, temperature=0.0), prompts)
        )
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = [o.outputs[0].text for o in offline_llm.generate(prompts, params)]
    assert served == expected
    after = metrics(pd_stack)
    handoffs = after['skiff_pd_handoffs_total{outcome="transferred"}'] - before.get(
        'skiff_pd_handoffs_total{outcome="transferred"}', 0.0
    )
    assert handoffs == len(long)  # the short ones never left the decode worker
    assert after["skiff_pd_transfer_bytes_total"] > before.get("skiff_pd_transfer_bytes_total", 0)
    # the dashboard's hand-over latency panel reads this histogram (not the shared stack's)
    assert after["skiff_pd_transfer_seconds_count"] >= len(long)
    assert after['skiff_pd_handoffs_total{outcome="recomputed"}'] == 0


def test_seeded_sampling_equals_colocated(pd_stack, stack):
    rng = random.Random(4)
    prompts = [random_prompt(rng, n) for n in (700, 250)]
    kw = dict(max_tokens=16, temperature=0.9, top_p=0.95, seed=11)
    for prompt in prompts:
        assert complete(pd_stack, prompt, **kw) == complete(stack, prompt, **kw)


def test_a_prefill_worker_killed_at_the_first_token_loses_nothing(pd_stack, offline_llm):
    rng = random.Random(5)
    prompt = random_prompt(rng, 1200)
    before = metrics(pd_stack)
    stream = client_of(pd_stack).completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=10,
        temperature=0.0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    text = ""
    for i, chunk in enumerate(stream):
        if i == 0:  # its KV is on its way to the decode worker, or just got there
            pd_stack.kill("worker-0", signal.SIGKILL)
        text += chunk.choices[0].text
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    (expected,) = offline_llm.generate([prompt], params)
    assert text == expected.outputs[0].text
    # handed over before its first token streamed: transferred, or recomputed if the kill cut
    # the fetch short (the decode worker's log says so)
    after = metrics(pd_stack)
    outcomes = [f'skiff_pd_handoffs_total{{outcome="{o}"}}' for o in ("transferred", "recomputed")]
    assert sum(after[k] - before[k] for k in outcomes) == 1
