"""A real nats-server admitting clients through the auth callout, the callout's TokenReview
replaced by a function of the test (the one fake here; the real review is tested against the
local cluster's API server in tests/cluster/test_auth_callout.py): worker `w` reads only its
own plans and publishes only what a worker may, gateway `g` reads only its own outputs,
request-reply works on each user's own inboxes, and unknown, forged or missing tokens are
refused. Connections the callout admitted outlive the callout."""

from __future__ import annotations

import asyncio
import time

import nats
import pytest

from services.auth_callout.identity import POD_NAME, Refused, ReviewedToken
from shared import bus
from tests.auth_callout.broker import callout_broker

pytestmark = pytest.mark.e2e  # starts nats-server

# The fake TokenReview's tokens: "<service account>:<pod>"; "forged:*" is a bad signature.
KNOWN = {"gateway", "scheduler", "worker", "stranger"}


async def review(token: str) -> ReviewedToken:
    account, _, pod = token.partition(":")
    if account not in KNOWN:
        raise Refused("token not authenticated: invalid signature")
    return ReviewedToken(f"system:serviceaccount:ns:{account}", {POD_NAME: [pod]})


def _violations(errors: list[str]) -> list[str]:
    return sorted(e for e in errors if "permissions violation" in e)


async def _connect(url: str, token_file, user: str, errors: list[str]):
    async def on_error(e: Exception) -> None:
        errors.append(str(e))

    options = bus.ConnectOptions(user=user, token_file=str(token_file))
    return await nats.connect(url, error_cb=on_error, **options.nats_kwargs())


def _token_file(tmp_path, token: str):
    path = tmp_path / token.replace(":", "-")
    path.write_text(token + "\n")
    return path


def test_each_pod_gets_its_own_subjects_only(tmp_path):
    async def run(broker) -> None:
        async with broker.callout(review):
            errors: list[str] = []
            worker = await _connect(broker.url, _token_file(tmp_path, "worker:w"), "w", errors)
            gateway = await _connect(broker.url, _token_file(tmp_path, "gateway:g"), "g", errors)
            admin = await broker.admin()
            got: list[str] = []

            async def on_msg(msg) -> None:
                got.append(msg.subject)

            for subject in ("skiff.worker.w.plan", "skiff.worker.x.plan", "skiff.worker.*.plan"):
                await worker.subscribe(subject, cb=on_msg)
            for subject in ("skiff.out.g", "skiff.out.h", "skiff.out.*"):
                await gateway.subscribe(subject, cb=on_msg)
            for nc in (worker, gateway):
                await bus.flush(nc)
            for subject in (
                "skiff.worker.w.plan",
                "skiff.worker.x.plan",
                "skiff.out.g",
                "skiff.out.h",
            ):
                await admin.publish(subject, b"m")
            # what only a scheduler may publish
            await worker.publish("skiff.worker.x.plan", b"forged plan")
            await gateway.publish("skiff.out.h", b"forged output")
            for nc in (worker, gateway, admin):
                await nc.flush()
            await asyncio.sleep(0.3)
            assert sorted(got) == ["skiff.out.g", "skiff.worker.w.plan"]
            assert _violations(errors) == [
                'nats: permissions violation for publish to "skiff.out.h"',
                'nats: permissions violation for publish to "skiff.worker.x.plan"',
                'nats: permissions violation for subscription to "skiff.out.*"',
                'nats: permissions violation for subscription to "skiff.out.h"',
                'nats: permissions violation for subscription to "skiff.worker.*.plan"',
                'nats: permissions violation for subscription to "skiff.worker.x.plan"',
            ]
            for nc in (worker, gateway, admin):
                await nc.close()

    with callout_broker(tmp_path) as broker:
        asyncio.run(run(broker))


def test_request_reply_on_each_users_own_inbox(tmp_path):
    """The gateway's submit reaches the scheduler, whose reply reaches the gateway's inbox."""

    async def run(broker) -> None:
        async with broker.callout(review):
            errors: list[str] = []
            scheduler = await _connect(
                broker.url, _token_file(tmp_path, "scheduler:s"), "s", errors
            )
            gateway = await _connect(broker.url, _token_file(tmp_path, "gateway:g"), "g", errors)

            async def on_submit(msg) -> None:
                await msg.respond(b"accepted")

            await scheduler.subscribe("skiff.req.submit", cb=on_submit)
            await bus.flush(scheduler)
            reply = await gateway.request("skiff.req.submit", b"req", timeout=5)
            assert reply.data == b"accepted"
            assert not _violations(errors)
            for nc in (scheduler, gateway):
                await nc.close()

    with callout_broker(tmp_path) as broker:
        asyncio.run(run(broker))


@pytest.mark.parametrize(
    "token",
    ["forged:w", "stranger:p", "worker:", "worker:bad.pod", ""],
    ids=["forged", "unknown-account", "no-pod", "bad-pod-name", "no-token"],
)
def test_refused_tokens_get_no_connection(tmp_path, token):
    async def run(broker) -> None:
        async with broker.callout(review):
            with pytest.raises(nats.errors.Error, match="Authorization Violation"):
                kwargs = {"token": token} if token else {}
                await nats.connect(broker.url, allow_reconnect=False, connect_timeout=3, **kwargs)

    with callout_broker(tmp_path) as broker:
        asyncio.run(run(broker))


def test_admitted_connections_outlive_the_callout(tmp_path):
    async def run(broker) -> None:
        errors: list[str] = []
        async with broker.callout(review):
            worker = await _connect(broker.url, _token_file(tmp_path, "worker:w"), "w", errors)
        # the callout is gone: new clients wait and are refused, the admitted one carries on
        with pytest.raises(nats.errors.Error, match="Authorization Violation"):
            # (the server's auth timeout passes first: it refuses, the client does not give up)
            await nats.connect(
                broker.url, token="worker:v", allow_reconnect=False, connect_timeout=15
            )
        got = asyncio.Event()

        async def on_plan(_msg) -> None:
            got.set()

        await worker.subscribe("skiff.worker.w.plan", cb=on_plan)
        await bus.flush(worker)
        admin = await broker.admin()
        await admin.publish("skiff.worker.w.plan", b"plan")
        await asyncio.wait_for(got.wait(), 5)
        assert worker.is_connected and not _violations(errors)
        for nc in (worker, admin):
            await nc.close()

    with callout_broker(tmp_path) as broker:
        asyncio.run(run(broker))


def test_the_token_file_is_read_at_each_connection(tmp_path):
    path = _token_file(tmp_path, "worker:w")
    token = bus.ConnectOptions(user="w", token_file=str(path)).nats_kwargs()["token"]
    assert token() == "worker:w"
    path.write_text("rotated\n")
    assert token() == "rotated"
    path.unlink()
    assert token() == ""  # logged; the server refuses and the next try reads again
    with pytest.raises(ValueError, match="nats_token_file"):
        bus.ConnectOptions.from_config(_config(str(path)))


def _config(token_file: str):
    from shared.config import NatsClientConfig

    return NatsClientConfig(nats_user="w", nats_token_file=token_file)


def test_a_connection_outlives_its_expiring_credential_by_renewing_it(tmp_path):
    """Each token (and so each user JWT) expires 2 s after its review: nats-server ends the
    connection then; `bus.connect` reconnects with the token file's current token, keeping
    its subscriptions, where a plain nats-py client stays closed."""
    expiry_s = 2
    reviews: list[str] = []

    async def short_lived(token: str) -> ReviewedToken:
        reviews.append(token)
        reviewed = await review(token)
        return ReviewedToken(reviewed.username, reviewed.extra, int(time.time()) + expiry_s)

    async def run(broker) -> None:
        async with broker.callout(short_lived):
            path = _token_file(tmp_path, "worker:w")
            options = bus.ConnectOptions(user="w", token_file=str(path))
            renewing = await bus.connect(broker.url, "w", options=options)
            plain = await nats.connect(broker.url, **options.nats_kwargs())
            got: list[bytes] = []

            async def on_plan(msg) -> None:
                got.append(msg.data)

            await renewing.subscribe("skiff.worker.w.plan", cb=on_plan)
            await bus.flush(renewing)
            path.write_text("worker:w\n")  # the kubelet's rotation: same identity, new token
            deadline = time.monotonic() + 5 * expiry_s
            while len(reviews) < 4:  # both first connections, then two renewals
                assert time.monotonic() < deadline, f"renewed {len(reviews) - 2} times"
                await asyncio.sleep(0.05)
            assert plain.is_closed, "nats-server did not end the expired connection"
            await bus.flush(renewing)  # reconnected, its subscription made again
            admin = await broker.admin()
            await admin.publish("skiff.worker.w.plan", b"after")
            await admin.flush()
            await asyncio.sleep(0.3)
            assert got == [b"after"]
            for nc in (renewing, admin):
                await nc.close()

    with callout_broker(tmp_path) as broker:
        asyncio.run(run(broker))
