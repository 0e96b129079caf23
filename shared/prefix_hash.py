"""Chained hashes of a token sequence's full KV blocks, the keys of the prefix cache.

Block i's hash covers its parent's hash and its own tokens, so equal hashes mean equal
prefixes. The scheduler indexes every tier of every worker by them and gateways route on
them (`shared/prefix_summary.py`), so both must compute them alike: this module is the one
definition.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import msgspec

ROOT_HASH = b"skiff-prefix-root"


def prefix_root(lora_name: str | None = None) -> bytes:
    """The parent hash of a sequence's first block: `ROOT_HASH` for the base model, one of its
    own for each LoRA adapter (its KV differs from the base model's on the same tokens)."""
    if lora_name is None:
        return ROOT_HASH
    return hashlib.sha256(msgspec.msgpack.encode((ROOT_HASH, "lora", lora_name))).digest()


def hash_block(
    parent_hash: bytes, token_ids: list[int], extra_keys: tuple[object, ...] = ()
) -> bytes:
    """Chained hash of one full block: (parent hash, its tokens, extra keys)."""
    payload = msgspec.msgpack.encode((parent_hash, token_ids, extra_keys))
    return hashlib.sha256(payload).digest()


def iter_block_hashes(
    token_ids: list[int], block_size: int, start_block: int = 0, parent_hash: bytes = ROOT_HASH
) -> Iterator[bytes]:
    """Chained hashes of the full blocks of `token_ids` from block `start_block` on, whose
    predecessor hashed to `parent_hash`; lazily, so a lookup can stop at its first miss."""
    for start in range(start_block * block_size, len(token_ids) - block_size + 1, block_size):
        parent_hash = hash_block(parent_hash, token_ids[start : start + block_size])
        yield parent_hash
