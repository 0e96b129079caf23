"""The generated NATS users and permissions: the rendered authorization block, and a real
nats-server enforcing it (a worker reads only its own plans, replies reach only their asker)."""

from __future__ import annotations

import asyncio
import json
import stat

import nats
import pytest

from services.launcher import Stack, StackConfig
from services.worker.config import RunnerConfig
from shared import bus
from shared.nats_auth import (
    ADMIN,
    CALLOUT_HEARTBEAT,
    CALLOUT_USER,
    GATEWAY,
    SCHEDULER,
    WORKER,
    AuthCallout,
    ModelSubjects,
    NatsUser,
    ServerTls,
    authorization_block,
    main,
    permissions,
    server_config,
)
from shared.wire import SchedulerStats, SchedulerStatsRequest, encode


def _user(role: str, *worker_ids: str, name: str | None = None) -> NatsUser:
    return NatsUser(name or role, "pw", role, worker_ids)


def test_gateway_permissions_cover_every_shard_and_nothing_of_workers():
    perms = permissions(_user(GATEWAY), "p", 2)
    assert perms is not None and not perms.allow_responses
    assert perms.publish == (
        "p.shard0.req.submit",
        "p.shard0.req.abort",
        "p.shard0.lora.adapters",
        "p.shard1.req.submit",
        "p.shard1.req.abort",
        "p.shard1.lora.adapters",
        "p.gateway.heartbeat",
        "p.shard0.gateway.heartbeat",
        "p.shard1.gateway.heartbeat",
    )
    assert perms.subscribe == (
        "p.shard0.out.*",
        "p.shard0.scheduler.heartbeat",
        "p.shard1.out.*",
        "p.shard1.scheduler.heartbeat",
        "_INBOX.gateway.>",
        CALLOUT_HEARTBEAT,
    )


def test_scheduler_permissions_answer_requests_without_an_inbox():
    perms = permissions(_user(SCHEDULER), "p", 1)
    assert perms is not None and perms.allow_responses
    assert perms.publish == (
        "p.out.*",
        "p.worker.*.plan",
        "p.worker.*.lora_check",
        "p.scheduler.heartbeat",
    )
    assert perms.subscribe == (
        "p.req.submit",
        "p.req.abort",
        "p.lora.adapters",
        "p.worker.*.hello",
        "p.worker.*.heartbeat",
        "p.worker.*.goodbye",
        "p.worker.*.result",
        "p.scheduler.stats",
        "p.gateway.heartbeat",
        "_INBOX.scheduler.>",
        CALLOUT_HEARTBEAT,
    )


def test_a_worker_user_gets_only_its_own_workers_plans_on_their_shards():
    perms = permissions(_user(WORKER, "w-2", "w-3", name="pod"), "p", 2)
    assert perms is not None and perms.allow_responses  # it answers LoRA checks
    assert perms.subscribe == (
        "p.shard0.worker.w-2.plan",
        "p.shard0.worker.w-2.lora_check",
        "p.shard0.scheduler.heartbeat",
        "p.shard1.worker.w-3.plan",
        "p.shard1.worker.w-3.lora_check",
        "p.shard1.scheduler.heartbeat",
        CALLOUT_HEARTBEAT,
    )
    assert perms.publish == (
        "p.shard0.worker.w-2.hello",
        "p.shard0.worker.w-2.heartbeat",
        "p.shard0.worker.w-2.goodbye",
        "p.shard0.worker.w-2.result",
        "p.shard1.worker.w-3.hello",
        "p.shard1.worker.w-3.heartbeat",
        "p.shard1.worker.w-3.goodbye",
        "p.shard1.worker.w-3.result",
    )
    assert permissions(_user(ADMIN), "p", 2) is None  # everything


def test_several_models_gateway_and_scheduler_reach_all_a_worker_only_its_own():
    models = [ModelSubjects("q", 2)]
    gateway = permissions(_user(GATEWAY), "p", 1, models)
    assert gateway is not None
    assert gateway.publish == (
        "p.req.submit",
        "p.req.abort",
        "p.lora.adapters",
        "p.gateway.heartbeat",
        "q.shard0.req.submit",
        "q.shard0.req.abort",
        "q.shard0.lora.adapters",
        "q.shard1.req.submit",
        "q.shard1.req.abort",
        "q.shard1.lora.adapters",
        "q.gateway.heartbeat",
        "q.shard0.gateway.heartbeat",
        "q.shard1.gateway.heartbeat",
    )
    assert gateway.subscribe[-2:] == ("_INBOX.gateway.>", CALLOUT_HEARTBEAT)
    scheduler = permissions(_user(SCHEDULER), "p", 1, models)
    assert scheduler is not None and scheduler.allow_responses
    assert {"p.req.submit", "q.shard1.req.submit"} <= set(scheduler.subscribe)
    worker = NatsUser("q-worker-1", "pw", WORKER, ("q-worker-1",), prefix="q")
    perms = permissions(worker, "p", 1, models)
    assert perms is not None
    assert perms.subscribe == (
        "q.shard1.worker.q-worker-1.plan",
        "q.shard1.worker.q-worker-1.lora_check",
        "q.shard1.scheduler.heartbeat",
        CALLOUT_HEARTBEAT,
    )
    assert all(s.startswith("q.shard1.worker.q-worker-1.") for s in perms.publish)
    with pytest.raises(ValueError, match="no model has prefix"):
        permissions(NatsUser("w", "pw", WORKER, ("w",), prefix="r"), "p", 1, models)


def test_users_are_checked():
    with pytest.raises(ValueError, match="worker ids"):
        NatsUser("w", "pw", WORKER)
    with pytest.raises(ValueError, match="worker ids"):
        NatsUser("g", "pw", GATEWAY, ("w-0",))
    with pytest.raises(ValueError, match="must match"):
        NatsUser("w", "pw", WORKER, ("*",))  # would allow every worker's plans
    with pytest.raises(ValueError, match="role"):
        NatsUser("x", "pw", "root")
    with pytest.raises(ValueError, match="unique"):
        authorization_block([_user(GATEWAY), _user(GATEWAY)], "p", 1)


def test_the_authorization_block_lists_users_with_their_permissions():
    users = [_user(ADMIN), _user(SCHEDULER), _user(WORKER, "w-0", name="w-0")]
    text = authorization_block(users, "p", 1)
    assert text.startswith("authorization {")
    entries = json.loads(text.removeprefix("authorization "))["users"]
    assert entries[0] == {"user": "admin", "password": "pw"}
    assert entries[1]["permissions"]["allow_responses"] is True
    assert entries[2]["permissions"] == {
        "publish": {
            "allow": [
                "p.worker.w-0.hello",
                "p.worker.w-0.heartbeat",
                "p.worker.w-0.goodbye",
                "p.worker.w-0.result",
            ]
        },
        "subscribe": {
            "allow": [
                "p.worker.w-0.plan",
                "p.worker.w-0.lora_check",
                "p.scheduler.heartbeat",
                CALLOUT_HEARTBEAT,
            ]
        },
        "allow_responses": True,
    }
    tls = ServerTls("c.pem", "k.pem", "ca.pem")
    conf = server_config(users, "p", 1, tls=tls, max_payload=2048)
    assert conf.startswith('max_payload: 2048\ntls {"cert_file": "c.pem", "key_file": "k.pem", ')
    assert '"verify": true' in conf and server_config(None, "p", 1) == ""


def test_the_command_writes_a_private_config_from_password_files(tmp_path):
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    for user in ("admin", "gateway", "scheduler", "skiff-worker-0", "skiff-worker-1"):
        (secrets / user).write_text(f"{user}-pw\n")
    out = tmp_path / "nats.conf"
    pod1 = "skiff-worker-1=skiff-worker-1-0,skiff-worker-1-1"  # two simulated workers
    main(
        [
            "--subject-prefix", "p", "--password-dir", str(secrets), "--out", str(out),
            "--worker", "skiff-worker-0", "--worker", pod1,
        ]
    )  # fmt: skip
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    users = json.loads(out.read_text().removeprefix("authorization "))["users"]
    (secrets / "tiny-worker-0").write_text("pw")
    two_models = ["--model", "q:2", "--worker", "tiny-worker-0@q"]
    main(["--subject-prefix", "p", "--password-dir", str(secrets), "--out", str(out), *two_models])
    tiny = json.loads(out.read_text().removeprefix("authorization "))["users"][-1]
    assert tiny["permissions"]["subscribe"]["allow"][0] == "q.shard0.worker.tiny-worker-0.plan"
    assert [u["password"] for u in users][-1] == "skiff-worker-1-pw"
    assert users[-1]["permissions"]["subscribe"]["allow"] == [
        "p.worker.skiff-worker-1-0.plan",
        "p.worker.skiff-worker-1-0.lora_check",
        "p.scheduler.heartbeat",
        "p.worker.skiff-worker-1-1.plan",
        "p.worker.skiff-worker-1-1.lora_check",
        CALLOUT_HEARTBEAT,
    ]
    with pytest.raises(SystemExit):
        main(["--password-dir", str(tmp_path / "missing"), "--out", str(out)])
    main(["--tls-cert", "c.pem", "--tls-key", "k.pem", "--out", str(out)])  # TLS, no users
    assert out.read_text() == 'tls {"cert_file": "c.pem", "key_file": "k.pem"}\n'


def test_a_gateway_scoped_to_its_id_reads_only_its_own_outputs():
    gateway = NatsUser("g", "", GATEWAY, gateway_id="g")
    perms = permissions(gateway, "p", 2)
    unscoped = permissions(_user(GATEWAY, name="g"), "p", 2)
    assert perms is not None and unscoped is not None
    assert (
        perms.subscribe == tuple(s.replace("out.*", "out.g") for s in unscoped.subscribe)
        and "p.shard1.out.g" in perms.subscribe
    )
    assert perms.publish == unscoped.publish
    with pytest.raises(ValueError, match="gateway id"):
        NatsUser("s", "", SCHEDULER, gateway_id="g")
    with pytest.raises(ValueError, match="gateway id"):
        NatsUser("g", "", GATEWAY, gateway_id="*")  # a wildcard would widen it again


def test_the_command_writes_an_auth_callout_config(tmp_path):
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    for user in (ADMIN, CALLOUT_USER):
        (secrets / user).write_text(f"{user}-pw\n")
    out = tmp_path / "nats.conf"
    issuer = "A" + "B" * 55
    main(["--password-dir", str(secrets), "--auth-callout-issuer", issuer, "--out", str(out)])
    accounts, _, authorization = (
        out.read_text().removeprefix("accounts ").partition("\nauthorization ")
    )
    assert json.loads(accounts) == {
        "AUTH": {
            "users": [{"user": CALLOUT_USER, "password": "auth-callout-pw"}],
            "exports": [{"stream": CALLOUT_HEARTBEAT}],
        },
        "SKIFF": {
            "users": [{"user": ADMIN, "password": "admin-pw"}],
            "imports": [{"stream": {"account": "AUTH", "subject": CALLOUT_HEARTBEAT}}],
        },
    }
    assert json.loads(authorization) == {
        "auth_callout": {"issuer": issuer, "auth_users": [CALLOUT_USER, ADMIN], "account": "AUTH"}
    }
    for wrong in (
        ["--auth-callout-issuer", issuer],  # no --password-dir
        ["--password-dir", str(secrets), "--auth-callout-issuer", "U" + "B" * 55],
        ["--password-dir", str(secrets), "--auth-callout-issuer", issuer, "--worker", "w"],
    ):
        with pytest.raises(SystemExit):
            main([*wrong, "--out", str(out)])
    with pytest.raises(ValueError, match="exclude"):
        server_config([_user(ADMIN)], "p", 1, callout=AuthCallout(issuer, "a", "b"))


@pytest.fixture
def broker():
    """Our nats-server with the users of a stack of two (non-simulated) workers."""
    server = Stack(StackConfig(RunnerConfig(model_dir=""), workers=2))
    server.start_nats()
    yield server
    server.stop()


@pytest.mark.e2e  # starts nats-server
def test_the_server_enforces_plans_per_worker_and_private_replies(broker):
    async def run() -> None:
        errors: list[str] = []

        async def on_error(e: Exception) -> None:
            errors.append(str(e))

        def kwargs(user: str) -> dict:
            return broker.nats_options(user)["options"].nats_kwargs()

        scheduler = await nats.connect(broker.nats_url, **kwargs(SCHEDULER))
        worker = await nats.connect(broker.nats_url, error_cb=on_error, **kwargs("worker-0"))
        admin = await bus.connect(broker.nats_url, "admin", **broker.nats_options())
        plans: list[str] = []

        async def on_plan(msg) -> None:
            plans.append(msg.subject)

        await worker.subscribe("skiff.worker.worker-0.plan", cb=on_plan)
        await worker.subscribe("skiff.worker.worker-1.plan", cb=on_plan)
        await worker.subscribe("_INBOX.admin.>", cb=on_plan)
        await bus.flush(worker)
        for w in ("worker-0", "worker-1"):
            await scheduler.publish(f"skiff.worker.{w}.plan", b"plan")
        await bus.flush(scheduler)

        async def on_stats(msg) -> None:  # the scheduler answers on the admin's inbox
            await msg.respond(encode(SchedulerStats(epoch="e", num_requests=3)))

        await scheduler.subscribe("skiff.scheduler.stats", cb=on_stats)
        await bus.flush(scheduler)
        stats = await bus.request(
            admin, "skiff.scheduler.stats", SchedulerStatsRequest(), SchedulerStats, 5
        )
        assert stats.num_requests == 3
        await asyncio.sleep(0.3)
        assert plans == ["skiff.worker.worker-0.plan"]
        assert sorted(e for e in errors if "permissions violation" in e) == [
            'nats: permissions violation for subscription to "_inbox.admin.>"',
            'nats: permissions violation for subscription to "skiff.worker.worker-1.plan"',
        ]
        for nc in (scheduler, worker, admin):
            await nc.close()

    asyncio.run(run())


@pytest.mark.e2e  # starts nats-server
def test_a_workers_goodbye_reaches_the_scheduler(broker):
    async def run() -> None:
        def kwargs(user: str) -> dict:
            return broker.nats_options(user)["options"].nats_kwargs()

        scheduler = await nats.connect(broker.nats_url, **kwargs(SCHEDULER))
        worker = await nats.connect(broker.nats_url, **kwargs("worker-1"))
        got = asyncio.Event()

        async def on_goodbye(_msg) -> None:
            got.set()

        await scheduler.subscribe("skiff.worker.*.goodbye", cb=on_goodbye)
        await bus.flush(scheduler)
        await worker.publish("skiff.worker.worker-1.goodbye", b"bye")
        await worker.flush()
        await asyncio.wait_for(got.wait(), 5)
        for nc in (scheduler, worker):
            await nc.close()

    asyncio.run(run())


@pytest.mark.e2e  # starts nats-server
def test_a_worker_publishes_only_as_itself(broker):
    """worker-0's credential cannot send a hello, heartbeat, goodbye or result as worker-1."""

    async def run() -> None:
        errors: list[str] = []

        async def on_error(e: Exception) -> None:
            errors.append(str(e))

        def kwargs(user: str) -> dict:
            return broker.nats_options(user)["options"].nats_kwargs()

        scheduler = await nats.connect(broker.nats_url, **kwargs(SCHEDULER))
        worker = await nats.connect(broker.nats_url, error_cb=on_error, **kwargs("worker-0"))
        heard: list[str] = []

        async def on_msg(msg) -> None:
            heard.append(msg.subject)

        kinds = ("hello", "heartbeat", "goodbye", "result")
        for kind in kinds:
            await scheduler.subscribe(f"skiff.worker.*.{kind}", cb=on_msg)
        await bus.flush(scheduler)
        for w in ("worker-1", "worker-0"):
            for kind in kinds:
                await worker.publish(f"skiff.worker.{w}.{kind}", b"x")
        await bus.flush(worker)
        await asyncio.sleep(0.3)
        assert heard == [f"skiff.worker.worker-0.{kind}" for kind in kinds]
        assert sorted(e for e in errors if "permissions violation" in e) == sorted(
            f'nats: permissions violation for publish to "skiff.worker.worker-1.{kind}"'
            for kind in kinds
        )
        for nc in (scheduler, worker):
            await nc.close()

    asyncio.run(run())
