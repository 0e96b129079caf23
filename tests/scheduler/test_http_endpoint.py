"""The scheduler's /health, /ready and /metrics over real HTTP, with a scheduler on a real
nats-server: not ready until it serves, ready while it serves, not ready once it hands over; a
standby replica is ready and exports nothing."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request

from services.launcher import free_port
from services.scheduler.config import SchedulerServiceConfig
from services.scheduler.http_endpoint import HttpEndpoint
from services.scheduler.service import SchedulerService
from shared.config import SchedulerConfig


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_ready_while_serving(nats_url):
    config = SchedulerServiceConfig(
        nats_url=nats_url, metrics_port=free_port(), served_model_name="m"
    )

    async def run() -> None:
        endpoint = HttpEndpoint.start(config)
        port = config.metrics_port
        try:
            assert await asyncio.to_thread(get, port, "/ready") == (503, "starting\n")
            assert await asyncio.to_thread(get, port, "/health") == (200, "ok\n")
            service = SchedulerService(config, SchedulerConfig())
            endpoint.serve(service)
            assert await asyncio.to_thread(get, port, "/ready") == (503, "starting\n")
            await service.start()
            assert await asyncio.to_thread(get, port, "/ready") == (200, "ok\n")
            status, text = await asyncio.to_thread(get, port, "/metrics")
            assert status == 200 and 'vllm:num_requests_waiting{model_name="m"} 0.0' in text
            await service.hand_over()
            assert await asyncio.to_thread(get, port, "/ready") == (503, "leaving\n")
        finally:
            endpoint.stop()

    asyncio.run(run())


def test_a_standby_is_ready_and_exports_nothing():
    config = SchedulerServiceConfig(metrics_port=free_port(), leader_election=True)

    async def run() -> None:
        endpoint = HttpEndpoint.start(config)
        try:
            assert await asyncio.to_thread(get, config.metrics_port, "/ready") == (200, "ok\n")
            status, text = await asyncio.to_thread(get, config.metrics_port, "/metrics")
            assert status == 200 and "vllm:" not in text
        finally:
            endpoint.stop()

    asyncio.run(run())


def test_a_port_in_use_is_logged_and_not_fatal(caplog):
    taken = SchedulerServiceConfig(metrics_port=free_port())

    async def run() -> None:
        first = HttpEndpoint.start(taken)
        second = HttpEndpoint.start(taken)
        first.stop()
        second.stop()

    asyncio.run(run())
    assert "cannot serve on 127.0.0.1" in caplog.text
