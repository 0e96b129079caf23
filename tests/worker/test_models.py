"""Our model classes against transformers on tiny random checkpoints: prefill and decode logits."""

from __future__ import annotations

import pytest
import torch

from services.worker.config import RunnerConfig
from services.worker.model_runner import ModelRunner
from shared.sampling_params import SamplingParams
from shared.wire import BatchPlan, CachedRequestData, NewRequestData

ARCHS = ["llama", "llama3-scaled", "mistral", "qwen2", "qwen3"]


def hf_logits(model_dir, token_ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0]  # [seq_len, vocab]


def our_logits(model_dir, prompts: list[list[int]], decode_tokens: list[list[int]]):
    """Prefill all prompts in one mixed step, then feed the given tokens one per step.

    Returns, per request, logits at the last prompt position and after each decode token.
    """
    runner = ModelRunner(RunnerConfig(model_dir=str(model_dir), num_blocks=64, max_model_len=256))
    captured: list[torch.Tensor] = []
    original = runner.model.compute_logits

    def capture(hidden):
        logits = original(hidden)
        captured.append(logits.clone())
        return logits

    runner.model.compute_logits = capture
    params = SamplingParams(temperature=0.0)
    blocks_per_req = 8
    new = [
        NewRequestData(
            req_id=f"r{i}",
            prompt_token_ids=p,
            sampling_params=params,
            block_ids=list(range(i * blocks_per_req, (i + 1) * blocks_per_req)),
            num_computed_tokens=0,
        )
        for i, p in enumerate(prompts)
    ]
    runner.execute(
        BatchPlan(
            step_id=0,
            new_reqs=new,
            num_scheduled_tokens={f"r{i}": len(p) for i, p in enumerate(prompts)},
        )
    )
    for step, tokens in enumerate(zip(*decode_tokens, strict=True), start=1):
        for i, t in enumerate(tokens):  # force the token we want instead of the sampled one
            row = runner.batch.req_id_to_index[f"r{i}"]
            runner.batch.token_ids[row, runner.batch.num_tokens[row] - 1] = t
        cached = [
            CachedRequestData(
                req_id=f"r{i}", new_block_ids=[], num_computed_tokens=len(prompts[i]) + step - 1
            )
            for i in range(len(prompts))
        ]
        runner.execute(
            BatchPlan(
                step_id=step,
                cached_reqs=cached,
                num_scheduled_tokens={f"r{i}": 1 for i in range(len(prompts))},
            )
        )
    return [torch.stack([c[i] for c in captured]) for i in range(len(prompts))]


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(tiny_models, arch):
    model_dir = tiny_models[arch]
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 200, (n,), generator=gen).tolist() for n in (5, 37, 100)]
    decode = [torch.randint(2, 200, (4,), generator=gen).tolist() for _ in prompts]
    ours = our_logits(model_dir, prompts, decode)
    for prompt, tokens, got in zip(prompts, decode, ours, strict=True):
        full = prompt + tokens
        ref = hf_logits(model_dir, full)[len(prompt) - 1 :]  # [1 + num_decode, vocab]
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_transformers_does_not_mistake_our_kernels_package_for_the_hub_one():
    from transformers.utils.import_utils import is_kernels_available

    import kernels  # ours, importable from the project root

    assert "skiff" in (kernels.__doc__ or "")
    assert not is_kernels_available()
