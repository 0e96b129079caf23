"""The gateway's view of the scheduler shards: readiness, context length, the choice of shard."""

from __future__ import annotations

from services.gateway.shards import Shards
from shared.wire import SchedulerHeartbeat


def _beat(epoch: str = "e", workers: int = 1, running: int = 0, waiting: int = 0, **kw):
    return SchedulerHeartbeat(
        epoch=epoch, num_ready_workers=workers, num_running=running, num_waiting=waiting, **kw
    )


def _shards(*beats: SchedulerHeartbeat | None) -> Shards:
    shards = Shards("p", len(beats), heartbeat_timeout=3.0)
    for shard, beat in zip(shards, beats, strict=True):
        if beat is not None:
            shard.heartbeat(beat)
    return shards


def test_one_shard_uses_the_plain_prefix():
    (shard,) = Shards("p", 1, heartbeat_timeout=3.0)
    assert shard.subjects.submit == "p.req.submit"
    assert [s.subjects.prefix for s in Shards("p", 2, 3.0)] == ["p.shard0", "p.shard1"]


def test_choose_the_least_loaded_per_ready_worker():
    # loads: 6/2 = 3, 2/1 = 2, 9/4 = 2.25
    shards = _shards(
        _beat(workers=2, running=4, waiting=2), _beat(running=2), _beat(workers=4, running=9)
    )
    assert shards.choose() == 1
    shards[1].submitted = 1  # ours since its heartbeat count: 3/1
    assert shards.choose() == 2
    assert shards.choose(exclude={2}) == 0


def test_ties_go_to_the_lower_index_and_a_heartbeat_resets_our_count():
    shards = _shards(_beat(running=1), _beat(running=1))
    assert shards.choose() == 0
    shards[0].submitted = 1
    assert shards.choose() == 1
    shards[0].heartbeat(_beat(running=1))
    assert shards[0].submitted == 0 and shards.choose() == 0


def test_stale_shards_and_shards_without_workers_are_skipped():
    shards = _shards(_beat(running=50), _beat(workers=0), _beat(running=9), None)
    shards[2].last_heartbeat -= 10  # silent longer than the heartbeat timeout
    assert shards.choose() == 0 and shards.ready
    assert shards.choose(exclude={0}) is None
    shards[0].last_heartbeat -= 10
    assert shards.choose() is None and not shards.ready


def test_max_model_len_is_the_smallest_of_the_fresh_shards():
    shards = _shards(_beat(max_model_len=4096), _beat(max_model_len=2048), _beat())
    assert shards.max_model_len == 2048
    shards[1].last_heartbeat -= 10
    assert shards.max_model_len == 4096
    shards[0].last_heartbeat -= 10  # none fresh: the smallest ever announced
    assert shards.max_model_len == 2048
    assert _shards(None, _beat()).max_model_len is None


def test_a_new_epoch_is_a_restart_but_the_first_one_is_not():
    (shard,) = Shards("p", 1, heartbeat_timeout=3.0)
    assert not shard.heartbeat(_beat("a"))
    assert not shard.heartbeat(_beat("a"))
    assert shard.heartbeat(_beat("b")) and shard.epoch == "b"
