"""Which gateways are alive: each publishes a `GatewayHeartbeat` every second or so, and each
submission is a sign of life too (a gateway that dies before its first heartbeat reached us
still has requests to abort). A gateway heard from and then silent for the timeout has died or
lost NATS, and with it the clients of its requests, so the scheduler aborts them."""

from __future__ import annotations

import time

from shared.wire import GatewayHeartbeat


class GatewayLiveness:
    def __init__(self) -> None:
        self.last_seen: dict[str, float] = {}  # gateway id -> time.monotonic()

    def on_heartbeat(self, beat: GatewayHeartbeat) -> None:
        self.heard(beat.gateway_id)

    def heard(self, gateway_id: str) -> None:
        """A heartbeat or a submission of `gateway_id` arrived."""
        self.last_seen[gateway_id] = time.monotonic()

    def reset(self) -> None:
        """Count every known gateway as just heard from: after our own NATS blip their
        heartbeats may have been lost, not they."""
        now = time.monotonic()
        self.last_seen = dict.fromkeys(self.last_seen, now)

    def silent(self, timeout_s: float) -> list[str]:
        """The gateways silent for longer than `timeout_s`, forgotten from now on (one that
        speaks again is followed again)."""
        now = time.monotonic()
        gone = [g for g, seen in self.last_seen.items() if now - seen > timeout_s]
        for gateway_id in gone:
            del self.last_seen[gateway_id]
        return gone
