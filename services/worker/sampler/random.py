"""Randomness keyed by (seed, output position), and inverse-CDF sampling with one draw per row.

A seeded row's uniform is a pure function of its seed and the index of the token being
sampled (a splitmix64 hash in int64 tensor ops, identical on every device), so the row samples
the same token whatever else is in the batch, after preemption and on another worker.
Unseeded rows draw from the sampler's own generator. One uniform per row picks a token by
inverting the row's cumulative distribution, so no per-token noise is generated.

"The same token" holds exactly for the hash and up to float rounding for the row's
probabilities: a different batch may change a reduction's summation order (or, upstream, the
model's GEMM tiling) in the last bit, which can flip a token only when u lies within ~1e-7 of
a CDF boundary.
"""

from __future__ import annotations

import torch

_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
_BLOCK = 1024  # tokens per block of the two-level inverse CDF


def _signed(x: int) -> int:
    """A uint64 constant as the int64 with the same bits."""
    return x - 2**64 if x >= 2**63 else x


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 of each int64 (as a uint64 bit pattern); multiplication wraps mod 2**64."""
    z = x + _signed(_GOLDEN)
    z = (z ^ _shr(z, 30)) * _signed(_MIX1)
    z = (z ^ _shr(z, 27)) * _signed(_MIX2)
    return z ^ _shr(z, 31)


def position_uniforms(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[n] int64 seeds and output positions -> [n] fp32 uniforms in (0, 1], 24-bit grid."""
    h = splitmix64(seeds ^ splitmix64(positions))
    return (_shr(h, 40) + 1).to(torch.float32) * 2.0**-24


def row_uniforms(
    seeded: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, generator: torch.Generator
) -> torch.Tensor:
    """[n] uniforms in (0, 1]: position-keyed for seeded rows, from `generator` otherwise."""
    drawn = 1.0 - torch.rand(len(seeds), generator=generator, device=generator.device)
    drawn = drawn.to(seeds.device)
    return torch.where(seeded, position_uniforms(seeds, positions), drawn)


def sample_inverse_cdf(logits: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row with probability softmax(logits), chosen by the uniform `u`.

    logits: [n, vocab] fp32, overwritten with unnormalized probabilities; u: [n] in (0, 1].
    Two levels keep the passes over the vocabulary to an exp and a block sum: find the block
    whose cumulative mass reaches u * total, then the token inside it. A masked (-inf) token
    is never returned; a row masked everywhere returns token 0.
    """
    probs = _exp_shifted_(logits)  # [n, vocab]
    vocab = probs.shape[1]
    size = min(_BLOCK, vocab)
    block_cum = _block_sums(probs, size).cumsum(dim=1)  # [n, num_blocks]
    target = (u * block_cum[:, -1]).unsqueeze(1)  # [n, 1]
    block = torch.searchsorted(block_cum, target).clamp_(max=block_cum.shape[1] - 1)  # [n, 1]
    before = block_cum.gather(1, (block - 1).clamp(min=0)).masked_fill_(block == 0, 0.0)
    cols = block * size + torch.arange(size, device=probs.device)  # [n, size]
    segment = probs.gather(1, cols.clamp(max=vocab - 1)).mul_(cols < vocab)  # [n, size]
    segment_cum = segment.cumsum(dim=1)
    within = torch.minimum(target - before, segment_cum[:, -1:])  # > 0 unless all masked
    offset = torch.searchsorted(segment_cum, within).clamp_(max=size - 1)
    return (block * size + offset).squeeze(1)


def _exp_shifted_(logits: torch.Tensor) -> torch.Tensor:
    top = logits.amax(dim=1, keepdim=True)  # [n, 1]
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    return logits.sub_(top).exp_()


def _block_sums(probs: torch.Tensor, size: int) -> torch.Tensor:
    """[n, vocab] -> [n, ceil(vocab / size)] sums of consecutive blocks."""
    vocab = probs.shape[1]
    full = vocab - vocab % size
    parts = []
    if full:
        parts.append(torch.unflatten(probs[:, :full], 1, (-1, size)).sum(dim=2))
    if full < vocab:
        parts.append(probs[:, full:].sum(dim=1, keepdim=True))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def sample_candidates(values: torch.Tensor, ids: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """values: [s, c] logits of each row's kept tokens in token-id order (-inf pads), ids:
    [s, c] their token ids, u: [s] -> [s] token ids, by the same inverse CDF as above."""
    cum = _exp_shifted_(values.clone()).cumsum(dim=1)  # [s, c]
    target = (u * cum[:, -1]).unsqueeze(1)
    pick = torch.searchsorted(cum, target).clamp_(max=cum.shape[1] - 1)
    return ids.gather(1, pick).squeeze(1)
