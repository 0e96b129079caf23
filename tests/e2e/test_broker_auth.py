"""The broker as an attack surface: a real stack (nats-server with generated users, scheduler,
simulated workers, gateway) against clients on its NATS with no credential, a wrong one, a
gateway's, a worker's, and the admin's.

Before per-service users, anyone on NATS read every prompt and output, submitted requests
without an API key, registered a fake worker that got real requests, and kept a stream from
finishing with fake scheduler heartbeats. Each attack must now fail (refused connection or
permission violation) while a real stream, running meanwhile, comes out exactly as without it.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import time
import urllib.request
from pathlib import Path

import nats
import nats.errors
import pytest
from openai import AsyncOpenAI, OpenAI

from services.worker.config import SimConfig
from shared import bus
from shared.sampling_params import SamplingParams
from shared.subjects import Subjects
from shared.wire import (
    BatchPlan,
    SchedulerHeartbeat,
    SubmitRequest,
    WorkerHello,
)
from tests.e2e.stats import scheduler_stats

MODEL = "SmolLM2-135M-Instruct"
SIM = SimConfig(sim_step_base_ms=20.0, sim_per_token_us=1.0, sim_per_req_us=1.0)  # ~50 tokens/s
MAX_TOKENS = 100  # a stream of about 2 s: the attacks run while it does
STREAM_DEADLINE_S = 60.0  # generous on a loaded machine; the attack used to stall it 90 s
S = Subjects()
FAKE_HELLO = WorkerHello(
    worker_id="evil-0",
    instance_id="x",
    model=MODEL,
    block_size=16,
    num_blocks=1 << 16,
    max_model_len=4096,
    max_num_seqs=256,
    device="sim",
    vocab_size=49152,
)


@pytest.fixture(scope="module")
def auth_stack(launch_stack):
    s = launch_stack("auth-stack", device="sim", workers=2, sim=SIM)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference(auth_stack) -> tuple[str, int]:
    """The stream's text and token count with nobody interfering."""
    client = OpenAI(base_url=f"{auth_stack.url}/v1", api_key="unused", max_retries=0, timeout=60)
    got = client.completions.create(**_request())
    assert got.usage.completion_tokens == MAX_TOKENS
    return got.choices[0].text, got.usage.completion_tokens


def _request() -> dict:
    return dict(
        model=MODEL, prompt="Hello", max_tokens=MAX_TOKENS, seed=5, extra_body={"ignore_eos": True}
    )


async def _stream(stack) -> tuple[str, int, float]:
    """A streamed completion: its text, token count and duration."""
    client = AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=90)
    start = time.monotonic()
    text, tokens = [], 0
    stream = await client.completions.create(
        **_request(), stream=True, stream_options={"include_usage": True}
    )
    async for chunk in stream:
        text += [c.text for c in chunk.choices]
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    await client.close()
    return "".join(text), tokens, time.monotonic() - start


class Intruder:
    """A raw NATS client as `user`, recording permission violations and what it receives."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.received: list[str] = []
        self.nc: nats.NATS

    async def connect(self, stack, user: str) -> Intruder:
        async def on_error(e: Exception) -> None:
            self.errors.append(str(e))

        kwargs = stack.nats_options(user)["options"].nats_kwargs()
        self.nc = await nats.connect(
            stack.nats_url, error_cb=on_error, allow_reconnect=False, **kwargs
        )
        return self

    async def listen(self, *subjects: str) -> None:
        async def on_msg(msg) -> None:
            self.received.append(msg.subject)

        for subject in subjects:
            await self.nc.subscribe(subject, cb=on_msg)
        await bus.flush(self.nc)  # the server has them before anything is sent to them

    def denied(self, action: str) -> set[str]:
        """Subjects the server refused for `action` ("publish" or "subscription"), in lower
        case as the client reports them."""
        pattern = rf'permissions violation for {action} to "([^"]+)"'
        return {m[1] for e in self.errors if (m := re.search(pattern, e))}


def _lower(*subjects: str) -> set[str]:
    return {s.lower() for s in subjects}


def _gateway_migrations(stack) -> float:
    with urllib.request.urlopen(f"{stack.url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    counter = r'^skiff_gateway_engine_migrated_total\{model_name="[^"]*"\} (\S+)$'
    match = re.search(counter, text, re.MULTILINE)
    assert match, "no migration counter on the gateway's /metrics"
    return float(match[1])


@pytest.mark.parametrize(
    "credentials",
    [{}, {"user": "gateway", "password": "guess"}, {"user": "admin", "password": ""}],
    ids=["none", "wrong-password", "empty-password"],
)
def test_a_client_without_valid_credentials_is_refused(auth_stack, credentials):
    # over TLS with the stack's CA: the credentials alone are wrong
    tls = bus.ConnectOptions(tls_ca=auth_stack.nats_tls_ca).nats_kwargs()

    async def attempt() -> None:
        nc = await nats.connect(
            auth_stack.nats_url,
            allow_reconnect=False,
            max_reconnect_attempts=0,
            connect_timeout=5,
            **credentials,
            **tls,
        )
        await nc.close()

    with pytest.raises(nats.errors.Error, match=r"(?i)authorization"):
        asyncio.run(attempt())


def test_a_gateway_credential_can_neither_read_nor_pose_as_a_worker_or_scheduler(
    auth_stack, reference
):
    """The four attacks with a gateway's credential, during a real stream."""
    readable = (
        ">",
        "skiff.>",
        S.plan("*"),
        S.submit,
        S.result("*"),
        S.worker_hello("*"),
        "_INBOX.>",
        S.output("*"),  # every gateway's outputs: the stack's gateway reads only its own
        S.output("another-gateway"),
    )
    forged = {
        S.worker_hello(FAKE_HELLO.worker_id): FAKE_HELLO,
        S.worker_heartbeat(FAKE_HELLO.worker_id): FAKE_HELLO,
        S.scheduler_heartbeat: SchedulerHeartbeat(epoch="f" * 32, num_ready_workers=0),
        S.plan("worker-0"): BatchPlan(step_id=1, scheduler_epoch="f" * 32, worker_session="1"),
    }

    async def run() -> tuple[Intruder, tuple[str, int, float]]:
        intruder = await Intruder().connect(auth_stack, "gateway")
        await intruder.listen(*readable, S.plan(FAKE_HELLO.worker_id))
        stream = asyncio.create_task(_stream(auth_stack))
        while not stream.done():  # forge all along the stream
            for subject, message in forged.items():
                await bus.publish(intruder.nc, subject, message)
            await intruder.nc.flush()
            await asyncio.sleep(0.1)
        await intruder.nc.close()
        return intruder, stream.result()

    intruder, (text, tokens, elapsed) = asyncio.run(run())
    assert (text, tokens) == reference
    assert elapsed < STREAM_DEADLINE_S
    assert intruder.received == []
    assert intruder.denied("subscription") == _lower(*readable, S.plan(FAKE_HELLO.worker_id))
    assert intruder.denied("publish") == _lower(*forged)
    assert set(scheduler_stats(auth_stack)["workers"]) == {"worker-0", "worker-1"}
    assert _gateway_migrations(auth_stack) == 0


def test_a_worker_credential_cannot_submit_or_read_prompts(auth_stack):
    """Submitting around the gateway (no API key) with the simulated workers' credential."""
    submit = SubmitRequest(
        req_id="intruder-1",
        gateway_id="intruder",
        prompt_token_ids=[1, 2, 3],
        sampling_params=SamplingParams(max_tokens=4),
    )

    async def run() -> Intruder:
        intruder = await Intruder().connect(auth_stack, "sim-workers")
        await intruder.listen(S.output("*"), S.submit, "_INBOX.>", S.plan("evil-0"))
        await bus.publish(intruder.nc, S.submit, submit)
        await bus.publish(intruder.nc, S.scheduler_heartbeat, FAKE_HELLO)
        await intruder.nc.flush()
        await asyncio.sleep(0.5)
        await intruder.nc.close()
        return intruder

    intruder = asyncio.run(run())
    assert intruder.denied("publish") == _lower(S.submit, S.scheduler_heartbeat)
    assert intruder.denied("subscription") == _lower(
        S.output("*"), S.submit, "_INBOX.>", S.plan("evil-0")
    )
    assert intruder.received == []
    assert scheduler_stats(auth_stack)["num_requests"] == 0


def test_a_stale_scheduler_epoch_overrides_nothing(auth_stack, reference):
    """Even with the admin's rights, heartbeats and plans of an older epoch (a zombie
    scheduler) neither move the gateway's requests nor reset a worker."""
    stale = "0" * 32
    messages = {
        S.scheduler_heartbeat: SchedulerHeartbeat(epoch=stale, num_ready_workers=1),
        S.plan("worker-0"): BatchPlan(step_id=1, scheduler_epoch=stale, worker_session="1"),
        S.plan("worker-1"): BatchPlan(step_id=1, scheduler_epoch=stale, worker_session="1"),
    }
    migrations = _gateway_migrations(auth_stack)

    async def run() -> tuple[str, int, float]:
        nc = await bus.connect(auth_stack.nats_url, "zombie", **auth_stack.nats_options())
        stream = asyncio.create_task(_stream(auth_stack))
        while not stream.done():
            for subject, message in messages.items():
                await bus.publish(nc, subject, message)
            await asyncio.sleep(0.1)
        await nc.close()
        return stream.result()

    text, tokens, elapsed = asyncio.run(run())
    assert (text, tokens) == reference
    assert elapsed < STREAM_DEADLINE_S
    assert _gateway_migrations(auth_stack) == migrations
    worker_log = (Path(auth_stack.config.log_dir) / "sim-workers.log").read_text()
    assert "new scheduler epoch" not in worker_log and "failed" not in worker_log


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture
def certificates(tmp_path) -> Path:
    """A CA, a server certificate for 127.0.0.1 signed by it, and a second, unrelated CA."""
    for ca in ("ca", "other-ca"):
        _openssl(
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", f"/CN={ca}",
            "-keyout", f"{ca}.key", "-out", f"{ca}.pem", cwd=tmp_path,
        )  # fmt: skip
    _openssl(
        "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
        "-keyout", "server.key", "-out", "server.csr", cwd=tmp_path,
    )  # fmt: skip
    (tmp_path / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    _openssl(
        "x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "1", "-extfile", "san.ext", "-out", "server.pem",
        cwd=tmp_path,
    )  # fmt: skip
    return tmp_path


def test_tls_with_a_custom_ca(launch_stack, certificates):
    """Every service reaches our nats-server over TLS, verified against the given CA; a plain
    connection or one that trusts another CA is refused."""
    stack = launch_stack(
        "tls-stack",
        device="sim",
        nats_server_tls_cert=str(certificates / "server.pem"),
        nats_server_tls_key=str(certificates / "server.key"),
        nats_tls_ca=str(certificates / "ca.pem"),
    )
    try:
        client = OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=60)
        got = client.completions.create(model=MODEL, prompt="Hi", max_tokens=4)
        assert got.usage.completion_tokens == 4
        assert scheduler_stats(stack)["workers"]  # the admin's client, over TLS

        admin = stack.nats_options()["options"]
        untrusting = bus.ConnectOptions(
            admin.user, admin.password, tls_ca=str(certificates / "other-ca.pem")
        )

        async def attempt(kwargs: dict) -> None:
            nc = await nats.connect(
                stack.nats_url,
                allow_reconnect=False,
                max_reconnect_attempts=0,
                connect_timeout=5,
                **kwargs,
            )
            await nc.close()

        plain = {"user": admin.user, "password": admin.password}
        for kwargs in (plain, untrusting.nats_kwargs()):
            with pytest.raises((nats.errors.Error, OSError)):
                asyncio.run(attempt(kwargs))
    finally:
        stack.stop()
