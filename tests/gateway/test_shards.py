"""The gateway's view of the scheduler shards: readiness, context length, the choice of shard."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from services.gateway.config import GatewayConfig
from services.gateway.metrics import GatewayMetrics
from services.gateway.shards import Route, Shards
from shared.prefix_hash import iter_block_hashes
from shared.prefix_summary import build
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


# ---- prefix-aware routing -------------------------------------------------------------------

SYSTEM = list(range(1000, 1320))  # a system prompt every conversation shares: 20 blocks of 16


def _held(*prompts: list[int], block_size: int = 16) -> dict[str, object]:
    """Heartbeat fields of a shard whose workers hold the full blocks of `prompts`."""
    hashes = [h for p in prompts for h in iter_block_hashes(p, block_size)]
    return {"block_size": block_size, "prefix_summary": build(hashes)}


def test_prefix_routing_picks_the_longest_prefix_held_not_the_shared_system_prompt():
    chat = SYSTEM + list(range(200))  # the history of one conversation: 32 full blocks
    shards = _shards(
        _beat(**_held(SYSTEM)),
        _beat(running=3, **_held(SYSTEM + list(range(5000, 5200)))),
        _beat(running=2, **_held(chat)),
    )
    turn = chat + list(range(7000, 7100))  # the next turn resends it
    assert shards.route(token_ids=turn) == Route(2, "prefix", 512)
    assert shards.choose(token_ids=turn) == 2
    assert shards.route(exclude={2}, token_ids=turn) == Route(0, "prefix", 320)  # tie: load
    shards[2].last_heartbeat -= 10  # unavailable, however much it holds
    assert shards.choose(token_ids=turn) == 0
    assert shards.route() == Route(0, "load")  # no tokens: by load


def test_no_match_and_load_routing_go_by_load():
    shards = _shards(_beat(running=1, **_held(SYSTEM)), _beat(**_held([7] * 64)), _beat())
    assert shards.route(token_ids=list(range(64))) == Route(1, "load", 0)
    assert shards.route(token_ids=SYSTEM[:15]) == Route(1, "load", 0)  # no full block
    assert shards.route(token_ids=SYSTEM) == Route(0, "prefix", 320)
    by_load = _shards(_beat(running=1, **_held(SYSTEM)), _beat())
    by_load.routing = "load"
    assert by_load.route(token_ids=SYSTEM) == Route(1, "load")


def test_a_too_busy_best_match_gives_way_to_the_least_loaded():
    shards = Shards("p", 2, heartbeat_timeout=3.0, max_imbalance=4.0)
    shards.heartbeat(0, _beat(workers=2, running=8, **_held(SYSTEM)))  # 4 per worker
    shards.heartbeat(1, _beat(**_held(SYSTEM[:160])))
    assert shards.route(token_ids=SYSTEM) == Route(0, "prefix", 320)  # 4 more: still
    shards[0].submitted = 1  # 4.5 more per worker
    assert shards.route(token_ids=SYSTEM) == Route(1, "load", 160)


def test_a_least_loaded_shard_that_holds_nothing_warms_up_by_load():
    shards = _shards(_beat(running=2, **_held(SYSTEM)), _beat(running=1, **_held(SYSTEM)), _beat())
    assert shards.route(token_ids=SYSTEM) == Route(2, "load", 0)  # just started
    shards[2].submitted = 2  # busier than shard 1 now: the longest prefix again
    assert shards.route(token_ids=SYSTEM) == Route(1, "prefix", 320)


def test_each_shard_matches_in_its_own_block_size():
    shards = _shards(
        _beat(running=1, **_held(SYSTEM[:256], block_size=16)),  # 16 blocks of 16
        _beat(running=1, **_held(SYSTEM, block_size=32)),  # 10 blocks of 32
        _beat(**_held(SYSTEM[:128], block_size=32)),
    )
    assert shards.route(token_ids=SYSTEM) == Route(1, "prefix", 320)
    assert shards.route(exclude={1}, token_ids=SYSTEM) == Route(0, "prefix", 256)


def test_a_summary_that_does_not_decode_counts_as_empty():
    (shard,) = Shards("p", 1, heartbeat_timeout=3.0)
    assert not shard.heartbeat(_beat(block_size=16, prefix_summary=b"garbage"))
    assert shard.num_ready_workers == 1 and len(shard.prefix_summary) == 0
    shard.heartbeat(_beat(**_held(SYSTEM)))
    assert len(shard.prefix_summary) == 20 and shard.block_size == 16


def test_routes_are_counted_per_shard_and_reason_and_exported():
    shards = _shards(_beat(**_held(SYSTEM)), _beat())
    shards.count(shards.route(token_ids=[*SYSTEM, 1, 2]))
    shards.count(shards.route(token_ids=SYSTEM))
    shards.count(shards.route(exclude={0}, token_ids=SYSTEM))
    assert shards[0].routed == {"prefix": 2} and shards[0].matched_tokens == 640
    assert shards[1].routed == {"load": 1} and shards[1].matched_tokens == 0

    engine = SimpleNamespace(ready=True, shards=shards)
    metrics = GatewayMetrics()
    metrics.add_engine("m", engine)
    value = metrics.registry.get_sample_value
    m = {"model_name": "m"}
    assert value("skiff_gateway_shard_requests_total", {**m, "shard": "0", "reason": "prefix"}) == 2
    assert value("skiff_gateway_shard_requests_total", {**m, "shard": "0", "reason": "load"}) == 0
    assert value("skiff_gateway_shard_requests_total", {**m, "shard": "1", "reason": "load"}) == 1
    assert value("skiff_gateway_shard_prefix_matched_tokens_total", {**m, "shard": "0"}) == 640
    assert value("skiff_gateway_shard_ready_workers", {**m, "shard": "1"}) == 1
    shards[1].heartbeat(_beat(leaving=True))
    assert value("skiff_gateway_shard_ready_workers", {**m, "shard": "1"}) == 0


def test_routing_settings_are_checked():
    with pytest.raises(ValueError, match="prefix or load"):
        Shards("p", 1, heartbeat_timeout=3.0, routing="random")
    with pytest.raises(ValueError, match="prefix or load"):
        GatewayConfig(shard_routing="random")
    with pytest.raises(ValueError, match="max_imbalance"):
        GatewayConfig(shard_routing_max_imbalance=-1)
    assert GatewayConfig().shard_routing == "prefix"
