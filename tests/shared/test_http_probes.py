"""The probe server: /health and /ready from checks, /metrics from a registry, over real HTTP;
and the event-loop check, which fails while the loop is blocked."""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter

from shared.http_probes import ProbeServer, loop_responds


def get(server: ProbeServer, path: str, method: str = "GET") -> tuple[int, str]:
    request = urllib.request.Request(f"http://127.0.0.1:{server.port}{path}", method=method)
    try:
        with urllib.request.urlopen(request, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.fixture
def probes():
    registry = CollectorRegistry()
    Counter("skiff_test_things", "Things.", registry=registry).inc(3)
    state: dict[str, str | None] = {"live": None, "ready": "loading"}
    server = ProbeServer(registry, live=lambda: state["live"], ready=lambda: state["ready"])
    server.start("127.0.0.1", 0)
    yield server, state
    server.stop()


def test_probes_answer_from_their_checks(probes):
    server, state = probes
    assert get(server, "/health") == (200, "ok\n")
    assert get(server, "/ready") == (503, "loading\n")
    state["ready"] = None
    assert get(server, "/ready") == (200, "ok\n")
    state["live"] = "a step has run for 400 s"
    assert get(server, "/health") == (503, "a step has run for 400 s\n")
    status, text = get(server, "/metrics")
    assert status == 200 and "skiff_test_things_total 3.0" in text
    assert get(server, "/nope")[0] == 404
    assert get(server, "/health", method="POST")[0] == 405


def test_a_failing_check_is_a_503_not_a_dead_server():
    def broken() -> str | None:
        raise RuntimeError("boom")

    server = ProbeServer(CollectorRegistry(), live=broken, ready=lambda: None)
    server.start("127.0.0.1", 0)
    try:
        status, text = get(server, "/health")
        assert status == 503 and "boom" in text
        assert get(server, "/ready") == (200, "ok\n")
    finally:
        server.stop()


def test_a_port_in_use_raises():
    first = ProbeServer(CollectorRegistry(), live=lambda: None, ready=lambda: None)
    first.start("127.0.0.1", 0)
    try:
        second = ProbeServer(CollectorRegistry(), live=lambda: None, ready=lambda: None)
        with pytest.raises(OSError):
            second.start("127.0.0.1", first.port)
    finally:
        first.stop()


def test_the_loop_check_fails_while_the_loop_is_blocked():
    async def run() -> tuple[str | None, str | None]:
        check = loop_responds(asyncio.get_running_loop(), 0.2)
        healthy = await asyncio.to_thread(check)
        result: list[str | None] = []
        probe = threading.Thread(target=lambda: result.append(check()))
        probe.start()
        time.sleep(0.5)  # blocks the loop
        probe.join()
        return healthy, result[0]

    healthy, blocked = asyncio.run(run())
    assert healthy is None
    assert blocked == "the event loop did not respond within 0.2 s"
    closed = asyncio.new_event_loop()
    closed.close()
    assert loop_responds(closed, 0.1)() == "the event loop is closed"
