"""Whether `skiff auth-callout` is alive, as a service connected through it sees it: the callout
publishes a `CalloutHeartbeat` every `interval_s` (`CALLOUT_HEARTBEAT`); three missed beats and
it is lost. nats-server keeps the connections the callout admitted while it is away, so the
service keeps serving; only its next (re)connection would wait for the callout. The service's
/health says so (and still passes): `health_note`.

`bus.connect` starts a watch for every connection made with a token file; a watch speaks for
as long as its connection is open (a closed connection hears nothing, and has nothing to lose).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from nats.aio.client import Client

from shared import bus
from shared.nats_auth import CALLOUT_HEARTBEAT
from shared.wire import CalloutHeartbeat

MISSED_BEATS = 3  # the callout is lost after this many heartbeat intervals without one
FIRST_BEAT_S = 15.0  # lost when no heartbeat came this long after the first connection


class CalloutWatch:
    """When the callout was last heard, and what /health says about it."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._last = clock()  # the first connection: the callout admitted it then
        self._deadline_s = FIRST_BEAT_S

    def heard(self, beat: CalloutHeartbeat) -> None:
        self._last = self._clock()
        self._deadline_s = MISSED_BEATS * beat.interval_s

    def note(self) -> str | None:
        """None while the callout is alive; else what an operator needs to know."""
        silent_s = self._clock() - self._last
        if silent_s <= self._deadline_s:
            return None
        return (
            f"auth callout lost: not heard for {silent_s:.0f} s; connections stay up, "
            "a reconnection waits for it"
        )


_watches: list[tuple[Client, CalloutWatch]] = []  # one per connection the callout admitted


async def watch(nc: Client) -> None:
    """Hear the callout's heartbeats on `nc` (a connection it admitted)."""
    watch = CalloutWatch()

    async def on_beat(beat: CalloutHeartbeat) -> None:
        watch.heard(beat)

    await bus.subscribe(nc, CALLOUT_HEARTBEAT, CalloutHeartbeat, on_beat)
    _watches.append((nc, watch))


def health_note() -> str | None:
    """The line /health adds about the callout (None: nothing to say, or no callout)."""
    notes = (w.note() for nc, w in list(_watches) if not nc.is_closed)  # a copy: probes run
    return next(filter(None, notes), None)  # on their own threads while connections are made
