"""A compact summary of a set of KV block hashes: a Bloom filter that a scheduler shard sends
in its heartbeat and a gateway reads to route a prompt to the shard holding its longest prefix.

The hashes are `shared.prefix_hash` digests (32 bytes of sha256), already uniform, so the k
bit positions of a hash are taken from its first k little-endian 32-bit words (k <= 8), each
mapped onto the m bits by multiply-shift. No false negatives; false positives at the rate
the sizing allows (about 1 % unless the size cap forces fewer bits per hash).

Plain Python (the gateway and scheduler images carry no numpy): building touches about
m ln 2 bits at most, whatever the number of hashes, since k shrinks as the cap binds.

Layout, little-endian: magic `SKPS`, format version (u8), k (u8), reserved (u16, 0), m bits
(u32, a multiple of 64), hashes inserted (u32), then the m bits (bit i is bit i % 8 of byte
i // 8). Empty bytes are the empty summary.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable

DEFAULT_MAX_BYTES = 64 * 1024
TARGET_FALSE_POSITIVE_RATE = 0.01
HASH_BYTES = 32  # shared.prefix_hash digests
MAX_NUM_HASHES = HASH_BYTES // 4  # bit positions per hash: one per 32-bit word of the digest

_MAGIC = b"SKPS"
_VERSION = 1
_HEADER = struct.Struct("<4sBBHII")  # magic, version, k, reserved, m bits, hashes inserted
MIN_MAX_BYTES = _HEADER.size + 8


def build(
    hashes: Iterable[bytes],
    max_bytes: int = DEFAULT_MAX_BYTES,
    false_positive_rate: float = TARGET_FALSE_POSITIVE_RATE,
) -> bytes:
    """The summary of `hashes` (duplicates count once), at most `max_bytes` long; sized for
    `false_positive_rate` when the cap allows. No hashes: empty bytes."""
    if max_bytes < MIN_MAX_BYTES:
        raise ValueError(f"max_bytes must be >= {MIN_MAX_BYTES}, got {max_bytes}")
    if not 0 < false_positive_rate < 1:
        raise ValueError(f"false_positive_rate must be in (0, 1), got {false_positive_rate}")
    unique = set(hashes)
    if not unique:
        return b""
    num_items = len(unique)
    wanted_bits = num_items * -math.log(false_positive_rate) / math.log(2) ** 2
    max_bits = (max_bytes - _HEADER.size) // 8 * 64
    num_bits = min(max(64, math.ceil(wanted_bits / 64) * 64), max_bits)
    k = min(max(1, round(num_bits / num_items * math.log(2))), MAX_NUM_HASHES)
    bits = bytearray(num_bits // 8)
    for block_hash in unique:
        for pos in _positions(block_hash, k, num_bits):
            bits[pos >> 3] |= 1 << (pos & 7)
    header = _HEADER.pack(_MAGIC, _VERSION, k, 0, num_bits, num_items)
    return header + bytes(bits)


_WORDS = struct.Struct(f"<{MAX_NUM_HASHES}I")


def _positions(block_hash: bytes, k: int, num_bits: int) -> list[int]:
    """The k bit positions of one hash."""
    if len(block_hash) != HASH_BYTES:
        raise ValueError(f"block hashes must be {HASH_BYTES} bytes")
    return [(word * num_bits) >> 32 for word in _WORDS.unpack(block_hash)[:k]]


class PrefixSummary:
    """A decoded summary: membership of block hashes and the longest prefix of a chain held.
    Raises ValueError on bytes that are not a summary."""

    def __init__(self, blob: bytes = b"") -> None:
        self.num_hashes = self.num_bits = self.num_items = 0
        self._bits = b""
        if not blob:
            return
        if len(blob) < _HEADER.size:
            raise ValueError(f"prefix summary truncated: {len(blob)} bytes")
        magic, version, k, _, num_bits, num_items = _HEADER.unpack_from(blob)
        if magic != _MAGIC:
            raise ValueError(f"not a prefix summary (magic {magic!r})")
        if version != _VERSION:
            raise ValueError(f"prefix summary format {version} unknown (this reads {_VERSION})")
        if not 1 <= k <= MAX_NUM_HASHES or num_bits == 0 or num_bits % 64:
            raise ValueError(f"prefix summary parameters invalid: k={k}, m={num_bits}")
        if len(blob) != _HEADER.size + num_bits // 8:
            raise ValueError(
                f"prefix summary of {num_bits} bits has {len(blob) - _HEADER.size} bytes of bits"
            )
        self.num_hashes, self.num_bits, self.num_items = k, num_bits, num_items
        self._bits = blob[_HEADER.size :]

    def __len__(self) -> int:
        """Hashes inserted."""
        return self.num_items

    @property
    def false_positive_rate(self) -> float:
        """The design rate of its parameters, (1 - e^(-k n / m))^k."""
        if not self.num_bits:
            return 0.0
        k = self.num_hashes
        return float((1 - math.exp(-k * self.num_items / self.num_bits)) ** k)

    def __contains__(self, block_hash: object) -> bool:
        return isinstance(block_hash, bytes) and self.longest_prefix([block_hash]) == 1

    def longest_prefix(self, block_hashes: list[bytes]) -> int:
        """How many leading hashes of the chain `block_hashes` are present: the scan stops at
        the first miss, so a false positive past it does not count."""
        if not self.num_bits or not block_hashes:
            return 0
        bits, k, m = self._bits, self.num_hashes, self.num_bits
        for i, block_hash in enumerate(block_hashes):
            if not all(bits[p >> 3] >> (p & 7) & 1 for p in _positions(block_hash, k, m)):
                return i
        return len(block_hashes)
