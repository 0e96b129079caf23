"""Structure survives migration: seeded JSON-schema-constrained streams at temperature 0.8,
through the official `openai` client, with a worker SIGKILLed mid-stream. The scheduler moves
its requests to the other worker, which rebuilds each grammar matcher from the tokens so far;
every stream ends with exactly the text an undisturbed run gives, valid against its schema.
Real processes: nats-server, scheduler, two CPU workers on the embedded SmolLM2, gateway."""

from __future__ import annotations

import asyncio
import json
import time

import jsonschema
import pytest
from openai import AsyncOpenAI

from services.offline import SamplingParams
from services.scheduler.config import SchedulerServiceConfig
from shared.structured_outputs import StructuredOutputsParams
from tests.e2e.stats import scheduler_stats

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "Describe three people who live in Paris, as JSON."
SEEDS = [3, 4, 5, 6]
MAX_TOKENS = 160
SCHEMA = {
    "type": "object",
    "properties": {
        "people": {
            "type": "array",
            "minItems": 3,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 16},
                    "age": {"type": "integer", "minimum": 18, "maximum": 99},
                    "job": {"enum": ["baker", "painter", "teacher", "driver"]},
                },
                "required": ["name", "age", "job"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["people"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def two_cpu_workers(launch_stack):
    service = SchedulerServiceConfig(worker_timeout=2.0)
    s = launch_stack("structured-migration", workers=2, scheduler_service=service)
    deadline = time.monotonic() + 120
    while len(scheduler_stats(s)["workers"]) < 2:
        assert time.monotonic() < deadline, "the second worker did not register"
        time.sleep(0.5)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def expected(offline_llm) -> list[str]:
    structure = StructuredOutputsParams(json=json.dumps(SCHEMA))
    params = [
        SamplingParams(
            temperature=0.8, seed=seed, max_tokens=MAX_TOKENS, structured_outputs=structure
        )
        for seed in SEEDS
    ]
    return [out.outputs[0].text for out in offline_llm.generate([PROMPT] * len(SEEDS), params)]


async def stream(client: AsyncOpenAI, seed: int, progress: list[int], i: int) -> tuple[str, str]:
    response = await client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0.8,
        seed=seed,
        stream=True,
        extra_body={"structured_outputs": {"json": SCHEMA}},
    )
    text, finish = "", None
    async for chunk in response:
        for c in chunk.choices:
            text += c.text
            finish = c.finish_reason or finish
            progress[i] += 1
    return text, finish


def test_structured_streams_survive_a_worker_kill(two_cpu_workers, expected):
    stack = two_cpu_workers

    async def run() -> tuple[list[tuple[str, str]], str]:
        client = AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="x", max_retries=0, timeout=300)
        async with client:  # closed on this loop, not collected later on a closed one
            progress = [0] * len(SEEDS)
            tasks = [
                asyncio.create_task(stream(client, s, progress, i)) for i, s in enumerate(SEEDS)
            ]
            while min(progress) < 8:  # every stream well under way, none finished
                assert not any(t.done() for t in tasks), "a stream ended before the kill"
                await asyncio.sleep(0.05)
            workers = (await asyncio.to_thread(scheduler_stats, stack))["workers"]
            victim = max(workers, key=lambda w: workers[w]["num_running"])
            assert workers[victim]["num_running"] > 0
            stack.kill(victim)
            return await asyncio.gather(*tasks), victim

    results, victim = asyncio.run(run())
    assert victim not in scheduler_stats(stack)["workers"]
    for (text, finish), want in zip(results, expected, strict=True):
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
        assert text == want
