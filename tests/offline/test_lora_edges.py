"""LoRA at the edges a user meets, in the offline engine on the embedded SmolLM2: an adapter at
the model's longest context (an 8,000-token prompt, prefilled in chunks) generates what the
same adapter merged into the weights does; the biggest batch, 256 requests over 16 adapters
in one step, gives each request the tokens it gets in a batch of its own adapter's requests.
The merged model's own exactness against transformers at 8,000 tokens:
tests/e2e/test_long_prompts.py."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.long_prompts import corpus
from bench.lora import write_adapter
from services.offline import LLM, SamplingParams
from shared.tokenizer import Tokenizer
from tests.lora_adapters import ALL_PROJECTIONS, base_model, make_adapters
from tests.offline.step_sizes import record_step_sizes

LONG = 8000
NEW_TOKENS = 8
NUM_ADAPTERS = 16
BATCH = 256


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def adapter_and_merged(smollm2_dir: Path, tmp_path_factory) -> tuple[Any, Path]:
    """A rank-16 adapter of every projection, and a model directory with it merged into the
    weights (peft's merge_and_unload), the embedded model's tokenizer beside them."""
    root = tmp_path_factory.mktemp("lora-edges")
    spec = {"r": 16, "lora_alpha": 32, "target_modules": ALL_PROJECTIONS}
    ((request, merged),) = make_adapters(base_model(smollm2_dir), root, {"r16": spec}).values()
    merged_dir = root / "merged"
    merged.save_pretrained(merged_dir)
    for path in smollm2_dir.iterdir():
        if path.is_file() and not (merged_dir / path.name).exists():
            shutil.copy(path, merged_dir / path.name)
    return request, merged_dir


def test_an_adapter_at_the_longest_context_generates_what_its_merged_weights_do(
    smollm2_dir, adapter_and_merged
):
    request, merged_dir = adapter_and_merged
    prompt = corpus(Tokenizer(smollm2_dir))[10_000 : 10_000 + LONG]
    llm = LLM(smollm2_dir, enable_lora=True, max_loras=1, max_lora_rank=16, max_model_len=8192)
    (with_adapter,) = llm.generate([prompt], greedy(NEW_TOKENS), lora_request=request)
    (base,) = llm.generate([prompt], greedy(NEW_TOKENS))
    llm.close()
    del llm
    merged = LLM(merged_dir, max_model_len=8192)
    (reference,) = merged.generate([prompt], greedy(NEW_TOKENS))
    merged.close()
    assert with_adapter.outputs[0].token_ids == reference.outputs[0].token_ids
    assert with_adapter.outputs[0].token_ids != base.outputs[0].token_ids  # it does change them


def test_256_requests_over_16_adapters_share_one_step(smollm2_dir, tmp_path):
    llm = LLM(
        smollm2_dir,
        enable_lora=True,
        max_loras=NUM_ADAPTERS,
        max_lora_rank=16,
        max_num_seqs=BATCH,
        enable_prefix_caching=False,
    )
    mc = llm.runner.model_config
    adapters = [
        write_adapter(tmp_path, f"a{i}", mc, 16, seed=i, b_scale=0.1) for i in range(NUM_ADAPTERS)
    ]
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(100, mc.vocab_size, (int(torch.randint(8, 40, (1,), generator=g)),),
                      generator=g).tolist()
        for _ in range(BATCH)
    ]  # fmt: skip
    loras = [adapters[i % NUM_ADAPTERS] for i in range(BATCH)]
    step_sizes = record_step_sizes(llm)
    together = llm.generate(prompts, greedy(4), lora_request=loras)
    assert max(step_sizes) == BATCH
    for a, adapter in enumerate(adapters):
        alone = llm.generate(prompts[a::NUM_ADAPTERS], greedy(4), lora_request=adapter)
        for mixed, own in zip(together[a::NUM_ADAPTERS], alone, strict=True):
            assert mixed.outputs[0].token_ids == own.outputs[0].token_ids
    base = llm.generate(prompts[:NUM_ADAPTERS], greedy(4))
    changed = [
        b.outputs[0].token_ids != t.outputs[0].token_ids
        for b, t in zip(base, together[:NUM_ADAPTERS], strict=True)
    ]
    assert sum(changed) >= NUM_ADAPTERS // 2  # the adapters do change the output
    llm.close()
