"""`--cpu-weights bf16_dot` and `q8_0` at the edges a user meets, in the offline engine on the
embedded SmolLM2: the bf16 x bf16 and Q8_0 x Q8_0 kernels' bits do not depend on how many
token rows they multiply (kernels/csrc/cpu_kernels.h; q8_0 quantizes each row of x on its own),
so an 8,000-token prompt (the model's longest context) prefilled in chunks of 256 generates
what it does in chunks of 2,048, and a request in a step of 256 generates what it does alone:
the same tokens with the same logprobs, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.long_prompts import corpus
from services.offline import LLM, GenerationOutput, SamplingParams
from shared.tokenizer import Tokenizer
from tests.offline.step_sizes import record_step_sizes

LONG = 8000
NEW_TOKENS = 8
BATCH = 256
FORMATS = pytest.mark.parametrize("cpu_weights", ["bf16_dot", "q8_0"])


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=5)


def generated(out: GenerationOutput) -> tuple[list[int], list[object]]:
    """The tokens and their top-5 logprobs."""
    return out.outputs[0].token_ids, out.outputs[0].logprobs


@FORMATS
def test_the_longest_prompt_generates_the_same_tokens_in_any_chunking(
    smollm2_dir: Path, cpu_weights: str
):
    prompt = corpus(Tokenizer(smollm2_dir))[20_000 : 20_000 + LONG]
    tokens = []
    for chunk in (256, 2048):
        llm = LLM(
            smollm2_dir, cpu_weights=cpu_weights, max_model_len=8192,
            max_num_batched_tokens=chunk, enable_prefix_caching=False,
        )  # fmt: skip
        (out,) = llm.generate([prompt], greedy(NEW_TOKENS))
        llm.close()
        tokens.append(generated(out))
    assert tokens[0] == tokens[1]
    assert len(set(tokens[0][0])) > 1  # a real continuation, not one token repeated


@FORMATS
def test_a_request_in_a_step_of_256_generates_what_it_does_alone(
    smollm2_dir: Path, cpu_weights: str
):
    llm = LLM(smollm2_dir, cpu_weights=cpu_weights, max_num_seqs=BATCH, enable_prefix_caching=False)
    g = torch.Generator().manual_seed(1)
    vocab = llm.runner.model_config.vocab_size
    prompts = [
        torch.randint(100, vocab, (int(torch.randint(8, 40, (1,), generator=g)),),
                      generator=g).tolist()
        for _ in range(BATCH)
    ]  # fmt: skip
    step_sizes = record_step_sizes(llm)
    together = llm.generate(prompts, greedy(4))
    assert max(step_sizes) == BATCH
    for i in (0, 77, 255):
        (alone,) = llm.generate([prompts[i]], greedy(4))
        assert generated(together[i]) == generated(alone), i
    llm.close()
