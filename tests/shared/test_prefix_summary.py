"""Prefix summaries: no false negatives, the design false-positive rate at the size cap,
longest prefixes of hash chains, and clear errors on bytes that are not a summary."""

from __future__ import annotations

import hashlib
import struct

import pytest

from shared.prefix_hash import iter_block_hashes
from shared.prefix_summary import MIN_MAX_BYTES, PrefixSummary, build


def digests(n: int, salt: str = "") -> list[bytes]:
    return [hashlib.sha256(f"{salt}{i}".encode()).digest() for i in range(n)]


def test_empty_summary():
    assert build([]) == b""
    empty = PrefixSummary(b"")
    assert len(empty) == 0 and digests(1)[0] not in empty
    assert empty.longest_prefix(digests(3)) == 0 and empty.false_positive_rate == 0.0


def test_no_false_negatives_and_duplicates_count_once():
    present = digests(5000)
    summary = PrefixSummary(build(present + present[:100]))
    assert len(summary) == 5000 and summary.num_hashes == 7  # sized for 1 %
    assert all(h in summary for h in present)
    assert "not bytes" not in summary


def test_false_positive_rate_near_the_design_at_the_cap():
    blob = build(digests(4000), max_bytes=4096 + 16)
    summary = PrefixSummary(blob)
    assert len(blob) == 4096 + 16 and summary.num_bits == 4096 * 8
    assert summary.num_hashes == 6  # round(8.19 bits per hash * ln 2)
    absent = digests(50_000, salt="absent")
    rate = sum(h in summary for h in absent) / len(absent)
    assert summary.false_positive_rate == pytest.approx(0.0197, abs=0.0005)
    assert rate == pytest.approx(summary.false_positive_rate, rel=0.2)


def test_uncapped_rate_is_the_target():
    summary = PrefixSummary(build(digests(2000)))
    assert summary.false_positive_rate < 0.011
    absent = digests(20_000, salt="absent")
    assert sum(h in summary for h in absent) / len(absent) < 0.02


def test_longest_prefix_of_a_chain_stops_at_the_first_miss():
    chain = list(iter_block_hashes(list(range(160)), 16))  # 10 blocks
    summary = PrefixSummary(build(chain[:6] + chain[7:]))  # block 6 evicted, 7.. still held
    assert summary.longest_prefix(chain) == 6
    assert summary.longest_prefix(chain[:4]) == 4
    assert summary.longest_prefix(list(iter_block_hashes(list(range(1, 161)), 16))) == 0
    assert summary.longest_prefix([]) == 0


def test_a_tiny_cap_still_has_no_false_negatives():
    present = digests(1000)
    summary = PrefixSummary(build(present, max_bytes=MIN_MAX_BYTES))
    assert (summary.num_bits, summary.num_hashes) == (64, 1)
    assert all(h in summary for h in present)


def test_bad_arguments():
    with pytest.raises(ValueError, match="max_bytes"):
        build(digests(1), max_bytes=MIN_MAX_BYTES - 1)
    with pytest.raises(ValueError, match="32 bytes"):
        build([b"short"])
    with pytest.raises(ValueError, match="32 bytes"):
        PrefixSummary(build(digests(1))).longest_prefix([b"short"])


@pytest.mark.parametrize(
    ("blob", "message"),
    [
        (b"SKPS", "truncated"),
        (b"XXXX" + bytes(12 + 8), "magic"),
        (struct.pack("<4sBBHII", b"SKPS", 2, 1, 0, 64, 1) + bytes(8), "format 2 unknown"),
        (struct.pack("<4sBBHII", b"SKPS", 1, 0, 0, 64, 1) + bytes(8), "parameters"),
        (struct.pack("<4sBBHII", b"SKPS", 1, 9, 0, 64, 1) + bytes(8), "parameters"),
        (struct.pack("<4sBBHII", b"SKPS", 1, 1, 0, 0, 1), "parameters"),
        (struct.pack("<4sBBHII", b"SKPS", 1, 1, 0, 60, 1) + bytes(8), "parameters"),
        (struct.pack("<4sBBHII", b"SKPS", 1, 1, 0, 128, 1) + bytes(8), "bytes of bits"),
        (build(digests(10)) + b"\0", "bytes of bits"),
    ],
)
def test_bad_blobs_fail_clearly(blob, message):
    with pytest.raises(ValueError, match=message):
        PrefixSummary(blob)
