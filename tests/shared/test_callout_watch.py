"""The auth callout's liveness as a service sees it: lost after three missed heartbeats (or no
first one), found again with the next; a passing /health of the probe server says so. The
real callout going away under a real stack: tests/auth_callout/test_callout_stack.py."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from shared import callout_watch
from shared.callout_watch import FIRST_BEAT_S, CalloutWatch
from shared.http_probes import ProbeServer
from shared.wire import CalloutHeartbeat
from tests.shared.test_http_probes import get


class FakeConnection:
    is_closed = False


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_lost_after_three_missed_beats_and_found_with_the_next():
    clock = Clock()
    watch = CalloutWatch(clock)
    assert watch.note() is None  # just admitted by it
    clock.now += FIRST_BEAT_S + 1
    assert watch.note() == (
        "auth callout lost: not heard for 16 s; connections stay up, a reconnection waits for it"
    )
    watch.heard(CalloutHeartbeat(interval_s=2.0))
    assert watch.note() is None
    clock.now += 6.0  # three intervals: not yet
    assert watch.note() is None
    clock.now += 0.5
    assert watch.note() is not None
    watch.heard(CalloutHeartbeat(interval_s=2.0))
    assert watch.note() is None


def test_health_passes_and_says_the_callout_is_lost(monkeypatch):
    server = ProbeServer(CollectorRegistry(), live=lambda: None, ready=lambda: None)
    server.start("127.0.0.1", 0)
    try:
        assert get(server, "/health") == (200, "ok\n")  # no callout: nothing to say
        clock = Clock()
        nc = FakeConnection()
        monkeypatch.setattr(callout_watch, "_watches", [(nc, CalloutWatch(clock))])
        assert get(server, "/health") == (200, "ok\n")
        clock.now += 60
        status, text = get(server, "/health")
        assert status == 200
        assert text == "ok\nauth callout lost: not heard for 60 s; connections stay up, " + (
            "a reconnection waits for it\n"
        )
        assert get(server, "/ready") == (200, "ok\n")
        nc.is_closed = True  # its connection is gone: the watch has nothing to say
        assert get(server, "/health") == (200, "ok\n")
    finally:
        server.stop()


@pytest.mark.parametrize("interval_s", [0.5, 5.0])
def test_the_deadline_follows_the_announced_interval(interval_s):
    clock = Clock()
    watch = CalloutWatch(clock)
    watch.heard(CalloutHeartbeat(interval_s=interval_s))
    clock.now += 3 * interval_s + 0.01
    assert watch.note() is not None
