"""Gateway liveness: a gateway heard from (a heartbeat or a submission) and then silent is
reported once."""

from __future__ import annotations

import time

from services.scheduler.gateways import GatewayLiveness
from shared.wire import GatewayHeartbeat


def test_a_silent_gateway_is_reported_once():
    gateways = GatewayLiveness()
    gateways.on_heartbeat(GatewayHeartbeat(gateway_id="gw-a"))
    gateways.on_heartbeat(GatewayHeartbeat(gateway_id="gw-b"))
    assert gateways.silent(timeout_s=5) == []
    gateways.last_seen["gw-a"] -= 10
    assert gateways.silent(timeout_s=5) == ["gw-a"]
    assert gateways.silent(timeout_s=5) == []  # forgotten until it speaks again
    gateways.on_heartbeat(GatewayHeartbeat(gateway_id="gw-a"))
    assert set(gateways.last_seen) == {"gw-a", "gw-b"}


def test_after_our_own_blip_every_gateway_gets_a_fresh_timeout():
    gateways = GatewayLiveness()
    gateways.on_heartbeat(GatewayHeartbeat(gateway_id="gw-a"))
    gateways.last_seen["gw-a"] -= 10
    gateways.reset()
    assert gateways.silent(timeout_s=5) == []
    assert time.monotonic() - gateways.last_seen["gw-a"] < 1


def test_a_submission_counts_as_a_sign_of_life():
    gateways = GatewayLiveness()
    gateways.heard("gw-new")  # its first heartbeat never arrived
    gateways.last_seen["gw-new"] -= 10
    assert gateways.silent(timeout_s=5) == ["gw-new"]
