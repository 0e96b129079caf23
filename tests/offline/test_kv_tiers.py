"""Lower KV tiers end to end in the offline engine (scheduler core and model runner in one
process, SmolLM2): multi-turn conversations whose histories outgrow the device pool are
answered exactly as when every prompt is computed from scratch, greedy and seeded, while their
prefixes come back from the host and disk tiers, and a corrupted disk tier only costs
recomputation."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest

from services.offline import LLM
from shared.sampling_params import SamplingParams

NUM_BLOCKS = 40  # 640 tokens: a fraction of the conversations' live history
TIERS = {"kv_offloading_size": 0.04, "kv_offloading_disk_size": 0.06}  # ~58 and ~87 slots


def conversations(num: int, rng: random.Random) -> list[list[int]]:
    """A shared system prompt and a first user message each, as token ids."""
    system = [rng.randrange(100, 20000) for _ in range(80)]
    return [system + [rng.randrange(100, 20000) for _ in range(50)] for _ in range(num)]


def params(seeded: bool, i: int) -> SamplingParams:
    if seeded:
        return SamplingParams(temperature=0.9, top_p=0.95, seed=1000 + i, max_tokens=8)
    return SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def chat(
    llm: LLM,
    convs: list[list[int]],
    turns: int,
    seeded: bool,
    rng: random.Random,
    between_turns: Callable[[int], None] = lambda turn: None,
) -> list[list[int]]:
    """Each turn: every conversation's history is answered, then grows by the answer and a
    new user message; returns every answer."""
    answers: list[list[int]] = []
    for turn in range(turns):
        outs = llm.generate(
            [list(c) for c in convs], [params(seeded, i) for i in range(len(convs))]
        )
        for conv, out in zip(convs, outs, strict=True):
            answer = out.outputs[0].token_ids
            answers.append(answer)
            conv.extend(answer + [rng.randrange(100, 20000) for _ in range(40)])
        between_turns(turn)
    return answers


@pytest.fixture(scope="module")
def recompute(smollm2_dir):
    """The reference: no prefix cache, every prompt computed."""
    llm = LLM(smollm2_dir, num_blocks=NUM_BLOCKS, enable_prefix_caching=False)
    yield llm
    llm.close()


@pytest.fixture
def tiered(smollm2_dir, tmp_path):
    llm = LLM(smollm2_dir, num_blocks=NUM_BLOCKS, kv_offloading_disk_path=str(tmp_path), **TIERS)
    yield llm
    llm.close()


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_answers_with_tiers_equal_recompute(recompute, tiered, seeded):
    expected = chat(recompute, conversations(6, random.Random(1)), 4, seeded, random.Random(2))
    got = chat(tiered, conversations(6, random.Random(1)), 4, seeded, random.Random(2))
    assert got == expected
    stats = tiered.scheduler.make_stats()
    assert stats.kv_tier_hits.get("host", 0) > 0
    assert stats.kv_tier_hits.get("disk", 0) > 0  # histories outgrew the host tier too
    assert stats.kv_tier_blocks_lost == 0


def test_a_corrupted_disk_tier_costs_recomputation_not_answers(recompute, tiered, tmp_path):
    (disk_file,) = Path(tmp_path).glob("*.bin")

    def corrupt(turn: int) -> None:
        """Flip a byte in every block-sized stretch of the disk tier's file."""
        block_bytes = tiered.runner.kv_tiers.stats.block_bytes
        data = bytearray(disk_file.read_bytes())
        for offset in range(block_bytes // 2, len(data), block_bytes):
            data[offset] ^= 0xFF
        disk_file.write_bytes(data)

    # five turns: the fourth spills blocks to disk that the fifth loads
    expected = chat(recompute, conversations(6, random.Random(3)), 5, False, random.Random(4))
    got = chat(tiered, conversations(6, random.Random(3)), 5, False, random.Random(4), corrupt)
    assert got == expected
    stats = tiered.runner.kv_tiers.stats
    assert stats.read(stats.load_failures).get("checksum", 0) > 0
    assert tiered.scheduler.make_stats().kv_tier_blocks_lost > 0
