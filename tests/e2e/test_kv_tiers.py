"""Lower KV tiers on a real stack: a CPU worker whose device pool holds a fraction of the
conversations in flight, with host and disk tiers. Multi-turn conversations through the
official OpenAI client get the answers the in-process engine gives, while their histories come
back from the lower tiers (the scheduler's stats and Prometheus counters say so)."""

from __future__ import annotations

import random
import re
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from openai import OpenAI

from shared.sampling_params import SamplingParams
from tests.e2e.stats import scheduler_stats

DEVICE_GIB = 0.03  # ~43 blocks of 16 tokens: under half the history of the conversations
TIER_GIB = 0.04  # ~58 slots each for host and disk


@pytest.fixture(scope="module")
def tiers_stack(launch_stack, smollm2_dir, tmp_path_factory):
    from services.launcher import free_port
    from services.worker.config import RunnerConfig

    runner = RunnerConfig(
        str(smollm2_dir),
        kv_cache_gib=DEVICE_GIB,
        kv_offloading_size=TIER_GIB,
        kv_offloading_disk_size=TIER_GIB,
        kv_offloading_disk_path=str(tmp_path_factory.mktemp("kv-disk")),
    )
    s = launch_stack("tiers-stack", runner=runner, scheduler_metrics_port=free_port())
    yield s
    s.stop()


def metric(stack, name: str) -> float:
    """The sum of a scheduler counter's series."""
    url = f"http://127.0.0.1:{stack.config.scheduler_metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    values = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return sum(float(v) for v in values)


def test_multi_turn_answers_with_tiers_equal_the_engine(tiers_stack, offline_llm):
    rng = random.Random(7)
    system = [rng.randrange(100, 20000) for _ in range(96)]
    convs = [system + [rng.randrange(100, 20000) for _ in range(60)] for _ in range(4)]
    client = OpenAI(base_url=f"{tiers_stack.url}/v1", api_key="unused", max_retries=0, timeout=300)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def answer(prompt: list[int]) -> str:
        out = client.completions.create(
            model="SmolLM2-135M-Instruct",
            prompt=prompt,
            max_tokens=8,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
        return out.choices[0].text

    with ThreadPoolExecutor(len(convs)) as pool:
        for _ in range(4):
            served = list(pool.map(answer, [list(c) for c in convs]))
            expected = offline_llm.generate([list(c) for c in convs], params)
            assert served == [e.outputs[0].text for e in expected]
            for conv, e in zip(convs, expected, strict=True):
                conv.extend(e.outputs[0].token_ids + [rng.randrange(100, 20000) for _ in range(50)])

    (worker,) = scheduler_stats(tiers_stack)["workers"].values()
    assert worker["kv_tier_blocks"]["host"] > 0 and worker["kv_tier_blocks"]["disk"] > 0
    assert worker["kv_tier_hits"].get("host", 0) > 0
    assert worker["kv_tier_blocks_lost"] == 0
    # The counters follow the cores' totals at each heartbeat (every 0.5 s): the last turn's
    # hits reach them within a few.
    hits = sum(worker["kv_tier_hits"].values())
    deadline = time.monotonic() + 5.0
    while metric(tiers_stack, "skiff_kv_tier_hits_total") != hits and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metric(tiers_stack, "skiff_kv_tier_hits_total") == hits
    assert metric(tiers_stack, "vllm:external_prefix_cache_hits_total") > 0
