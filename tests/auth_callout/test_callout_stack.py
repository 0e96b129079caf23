"""A real stack behind the auth callout: nats-server with the callout (its TokenReview the
test's function, as in test_callout_broker.py), and the scheduler, a simulated worker and the
gateway as processes, each presenting its own token file (no password anywhere): the
permissions the callout gives suffice to serve a completion end to end. When the callout goes
away, the stack keeps serving on the connections it has, and the gateway's /health says so."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from services.auth_callout.authorizer import Authorizer
from services.auth_callout.main import heartbeats, listen
from services.gateway.config import GatewayConfig
from services.launcher import SIM_WORKERS_USER, NatsConfigT, Stack, StackConfig, free_port
from services.worker.config import RunnerConfig
from shared.config import SchedulerConfig
from shared.nats_auth import GATEWAY, SCHEDULER
from tests.auth_callout.broker import PREFIX, ROLES, callout_broker
from tests.auth_callout.test_callout_broker import review

pytestmark = pytest.mark.e2e
HEARTBEAT_S = 0.5  # the services call the callout lost after three missed


class CalloutStack(Stack):
    """Each service connects with a token naming its service account and pod (the fake
    review's "<account>:<pod>"), its NATS user the pod."""

    def __init__(self, config: StackConfig, token_dir: Path) -> None:
        super().__init__(config)
        self.token_dir = token_dir

    def _as_nats_user(self, config: NatsConfigT, user: str) -> NatsConfigT:
        pod = "worker-0" if user == SIM_WORKERS_USER else user
        account = user if user in (GATEWAY, SCHEDULER) else "worker"
        token = self.token_dir / f"{pod}.token"
        token.write_text(f"{account}:{pod}\n")
        return dataclasses.replace(
            config, nats_url=self.nats_url, nats_user=pod, nats_token_file=str(token)
        )


def _complete(url: str) -> dict:
    body = {"model": "m", "prompt": [504, 3458, 282], "max_tokens": 8, "ignore_eos": True}
    request = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as resp:
        return json.loads(resp.read())


def _health(url: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(f"{url}/health", timeout=10) as resp:
        return resp.status, resp.read()


def test_a_completion_through_the_callout_and_after_it_is_lost(smollm2_dir, tmp_path):
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    with callout_broker(tmp_path) as broker:

        async def start_callout():
            nc = await broker.callout_connection()
            await listen(nc, Authorizer(ROLES, review, broker.signer, PREFIX, 1))
            await nc.flush()
            return nc, asyncio.create_task(heartbeats(nc, HEARTBEAT_S))

        async def stop_callout():
            beating.cancel()
            await callout.close()

        callout, beating = asyncio.run_coroutine_threadsafe(start_callout(), loop).result(10)
        logs = tmp_path / "logs"
        config = StackConfig(
            RunnerConfig(str(smollm2_dir), device="sim"),
            GatewayConfig(served_model_name="m", port=free_port(), gateway_id=GATEWAY),
            nats_url=broker.url,
            nats_auth=False,
            nats_tls=False,
            scheduler=SchedulerConfig(max_model_len=2048),
            scheduler_metrics_port=0,
            log_dir=str(logs),
        )
        stack = CalloutStack(config, tmp_path)
        try:
            stack.start(timeout_s=120)
            assert _complete(stack.url)["usage"]["completion_tokens"] == 8
            assert _health(stack.url) == (200, b"")

            # The callout goes away: connections stay, and /health (still 200) says so.
            asyncio.run_coroutine_threadsafe(stop_callout(), loop).result(10)
            deadline = time.monotonic() + 30
            while (health := _health(stack.url))[1] == b"":
                assert time.monotonic() < deadline, "/health never said the callout was lost"
                time.sleep(0.2)
            assert health[0] == 200
            assert json.loads(health[1])["warning"].startswith("auth callout lost")
            assert _complete(stack.url)["usage"]["completion_tokens"] == 8
        except Exception:
            for log in sorted(logs.glob("*.log")):
                print(f"--- {log.name}\n{log.read_text()[-3000:]}")
            raise
        finally:
            stack.stop()
            if not callout.is_closed:
                asyncio.run_coroutine_threadsafe(stop_callout(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
