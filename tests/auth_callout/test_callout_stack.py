"""A real stack behind the auth callout: nats-server with the callout (its TokenReview the
test's function, as in test_callout_broker.py), and the scheduler, a simulated worker and the
gateway as processes, each presenting its own token file (no password anywhere): the
permissions the callout gives suffice to serve a completion end to end."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import urllib.request
from pathlib import Path

import pytest

from services.auth_callout.authorizer import Authorizer
from services.auth_callout.main import listen
from services.gateway.config import GatewayConfig
from services.launcher import SIM_WORKERS_USER, NatsConfigT, Stack, StackConfig, free_port
from services.worker.config import RunnerConfig
from shared.config import SchedulerConfig
from shared.nats_auth import GATEWAY, SCHEDULER
from tests.auth_callout.broker import PREFIX, ROLES, callout_broker
from tests.auth_callout.test_callout_broker import review

pytestmark = pytest.mark.e2e


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


def test_a_completion_through_the_callout(smollm2_dir, tmp_path):
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    with callout_broker(tmp_path) as broker:

        async def start_callout():
            nc = await broker.callout_connection()
            await listen(nc, Authorizer(ROLES, review, broker.signer, PREFIX, 1))
            await nc.flush()
            return nc

        callout = asyncio.run_coroutine_threadsafe(start_callout(), loop).result(10)
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
            body = {"model": "m", "prompt": [504, 3458, 282], "max_tokens": 8, "ignore_eos": True}
            request = urllib.request.Request(
                f"{stack.url}/v1/completions",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=60) as resp:
                answer = json.loads(resp.read())
            assert answer["usage"]["completion_tokens"] == 8
        except Exception:
            for log in sorted(logs.glob("*.log")):
                print(f"--- {log.name}\n{log.read_text()[-3000:]}")
            raise
        finally:
            stack.stop()
            asyncio.run_coroutine_threadsafe(callout.close(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
