"""Tier sizes and the indices of blocks and slots in a plan's KV moves (torch-free: the
simulated runner uses them too)."""

from __future__ import annotations


def check_range(tier: str, indices: list[int], size: int) -> None:
    """IndexError unless every index is in [0, size)."""
    bad = [i for i in indices if not 0 <= i < size]
    if bad:
        raise IndexError(f"{tier} has {size} blocks: no block {bad[0]}")


def runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive slots: (position in `slots`, first slot, length)."""
    out: list[tuple[int, int, int]] = []
    for i, slot in enumerate(slots):
        if out and out[-1][1] + out[-1][2] == slot:
            pos, first, n = out[-1]
            out[-1] = (pos, first, n + 1)
        else:
            out.append((i, slot, 1))
    return out


def num_tier_blocks(gib: float, block_bytes: int) -> int:
    """Whole blocks in `gib` GiB."""
    return int(gib * 2**30) // block_bytes
