"""Shard subject prefixes and which shard owns a worker."""

from __future__ import annotations

from collections import Counter

import pytest

from shared.subjects import SUBJECT_PREFIX, Subjects, shard_prefixes, worker_prefix, worker_shard


def test_one_shard_keeps_the_prefix_and_shards_get_their_own():
    assert shard_prefixes("skiff", 1) == ["skiff"]
    prefixes = shard_prefixes("skiff", 3)
    assert prefixes == ["skiff.shard0", "skiff.shard1", "skiff.shard2"]
    assert all(SUBJECT_PREFIX.fullmatch(p) for p in prefixes)
    submits = {Subjects(p).submit for p in prefixes} | {Subjects("skiff").submit}
    assert len(submits) == 4  # no shard hears another's (or the unsharded) requests
    with pytest.raises(ValueError):
        shard_prefixes("skiff", 0)


def test_numbered_workers_alternate_between_shards():
    owners = [worker_shard(f"skiff-worker-{i}", 4) for i in range(64)]
    assert owners[:6] == [0, 1, 2, 3, 0, 1]
    assert Counter(owners) == {0: 16, 1: 16, 2: 16, 3: 16}
    assert worker_prefix("skiff", "sim-5", 2) == "skiff.shard1"
    assert worker_prefix("skiff", "sim-5", 1) == "skiff"


def test_unnumbered_worker_ids_hash_stably():
    assert worker_shard("gpu-node-a", 3) == worker_shard("gpu-node-a", 3)
    assert {worker_shard(f"node-{c}", 3) for c in "abcdefghij"} == {0, 1, 2}
