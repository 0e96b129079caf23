"""Which scheduler epoch workers and gateways follow."""

from __future__ import annotations

import time

from shared.epochs import EpochFollower, new_epoch, supersedes


def test_epochs_sort_by_start_time():
    first = new_epoch()
    time.sleep(0.001)
    second = new_epoch()
    assert len(first) == len(second) == 32 and first < second


def test_only_a_newer_epoch_or_a_silent_current_one_gives_way():
    assert supersedes("a", None, current_silent=False)  # the first one heard
    assert supersedes("b", "b", current_silent=False)
    assert supersedes("c", "b", current_silent=False)  # a restart
    assert not supersedes("a", "b", current_silent=False)  # a zombie
    assert supersedes("a", "b", current_silent=True)  # a restart on a clock behind


def test_a_follower_ignores_an_older_epoch_until_the_current_one_falls_silent():
    follower = EpochFollower(silence_s=0.2)
    assert follower.follow("b") and follower.follow("c")
    assert not follower.follow("b") and follower.current == "c"
    assert follower.follow("c")  # keeps it fresh
    time.sleep(0.25)
    assert follower.follow("b") and follower.current == "b"


def test_heartbeats_of_the_current_epoch_keep_an_idle_follower_on_it():
    follower = EpochFollower(silence_s=0.2)
    assert follower.follow("c")
    for _ in range(3):  # no plans for 0.3 s, but heartbeats
        time.sleep(0.1)
        follower.heard("c")
        follower.heard("b")  # a zombie's heartbeat refreshes nothing
    assert not follower.follow("b") and follower.current == "c"
