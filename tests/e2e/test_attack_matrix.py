"""The broker's attack matrix: every credential of a stack's nats-server, started as `skiff
serve` starts it (generated users, TLS on), against every other role's subjects: publishing
on them (forging), subscribing to them (reading) and sending requests to them (acting as that
role's client). Each attacker-target pair is one test, and every attempt must be refused by
the server while the same credential's own subjects still work (`test_own_subjects_work`).

What each role does is written out here by hand from the wire protocol (docs/architecture.md),
not derived from `shared.nats_auth`, so a permission that drifts from it fails a test. The
other attacks (tokens, plaintext, tenants, a worker's id inside its messages) are tested where
their parts live; docs/security.md lists them all.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from dataclasses import dataclass, field

import nats
import nats.errors
import pytest
from nats.aio.client import Client

from services.launcher import LOCAL_GATEWAY_ID, Stack, StackConfig
from services.worker.config import RunnerConfig
from shared import bus
from shared.nats_auth import ADMIN, CALLOUT_HEARTBEAT, inbox_prefix
from shared.subjects import Subjects

pytestmark = pytest.mark.e2e

S = Subjects()
WORKERS = ("worker-0", "worker-1")
OTHER_GATEWAY = "another-gateway"
SETTLE_S = 0.3  # for the server's asynchronous -ERR and for messages that must not arrive
REQUEST_TIMEOUT_S = 0.5


@dataclass(frozen=True)
class Owned:
    """The subjects a role uses: publishes on, subscribes to, and sends requests to."""

    publish: frozenset[str] = field(default_factory=frozenset)
    subscribe: frozenset[str] = field(default_factory=frozenset)
    request: frozenset[str] = field(default_factory=frozenset)


def _worker(worker_id: str) -> Owned:
    return Owned(
        publish=frozenset(
            {
                S.worker_hello(worker_id),
                S.worker_heartbeat(worker_id),
                S.worker_goodbye(worker_id),
                S.result(worker_id),
            }
        ),
        subscribe=frozenset(
            {S.plan(worker_id), S.lora_check(worker_id), S.scheduler_heartbeat, CALLOUT_HEARTBEAT}
        ),
    )


OWNED: dict[str, Owned] = {
    "gateway": Owned(
        publish=frozenset({S.submit, S.abort, S.lora_adapters, S.gateway_heartbeat}),
        subscribe=frozenset(
            {S.output(LOCAL_GATEWAY_ID), S.scheduler_heartbeat, CALLOUT_HEARTBEAT}
            | {f"{inbox_prefix('gateway')}.>"}
        ),
        request=frozenset({S.submit, S.lora_adapters}),
    ),
    "scheduler": Owned(
        publish=frozenset(
            {S.output(LOCAL_GATEWAY_ID), S.output(OTHER_GATEWAY), S.scheduler_heartbeat}
            | {x for w in WORKERS for x in (S.plan(w), S.lora_check(w))}
        ),
        subscribe=frozenset(
            {S.submit, S.abort, S.lora_adapters, S.gateway_heartbeat, S.scheduler_stats}
            | {f"{inbox_prefix('scheduler')}.>", CALLOUT_HEARTBEAT}
            | {S.worker_hello("*"), S.worker_heartbeat("*"), S.worker_goodbye("*"), S.result("*")}
        ),
        request=frozenset(S.lora_check(w) for w in WORKERS),
    ),
    **{w: _worker(w) for w in WORKERS},
    # targets only: another gateway's outputs, and the operator's scheduler stats
    OTHER_GATEWAY: Owned(subscribe=frozenset({S.output(OTHER_GATEWAY)})),
    ADMIN: Owned(publish=frozenset({S.scheduler_stats}), request=frozenset({S.scheduler_stats})),
}
ATTACKERS = ("gateway", "scheduler", *WORKERS)
WILDCARDS = (">", f"{S.prefix}.>", "_INBOX.>", S.output("*"), S.plan("*"), S.result("*"))


@pytest.fixture(scope="module")
def broker():
    """Our nats-server as a stack of two CPU workers starts it: generated users, TLS."""
    stack = Stack(StackConfig(RunnerConfig(model_dir=""), workers=len(WORKERS)))
    stack.start_nats()
    yield stack
    stack.stop()


class Connection:
    """A connection as one user, with the permission violations the server reported."""

    def __init__(self, nc: Client, errors: list[str]) -> None:
        self.nc, self.errors = nc, errors

    @classmethod
    async def connect(cls, broker: Stack, user: str) -> Connection:
        errors: list[str] = []

        async def on_error(e: Exception) -> None:
            errors.append(str(e))

        kwargs = broker.nats_options(user)["options"].nats_kwargs()
        nc = await nats.connect(broker.nats_url, error_cb=on_error, allow_reconnect=False, **kwargs)
        return cls(nc, errors)

    def denied(self, action: str) -> set[str]:
        """Subjects refused for `action` ("publish" or "subscription"), lower-cased as the
        client reports them."""
        pattern = rf'permissions violation for {action} to "([^"]+)"'
        return {m[1] for e in self.errors if (m := re.search(pattern, e))}


@dataclass
class Outcome:
    """What got through for one user: subjects it read, published and was answered on."""

    read: set[str] = field(default_factory=set)
    published: set[str] = field(default_factory=set)
    answered: set[str] = field(default_factory=set)
    denied_publish: set[str] = field(default_factory=set)
    denied_subscription: set[str] = field(default_factory=set)


async def _attempt(broker: Stack, user: str, subscribe, publish, request) -> Outcome:
    """`user` subscribes to, publishes on and sends requests to the given subjects while the
    admin publishes on each subscribed subject, watches every subject and answers every
    request."""
    me, admin = await Connection.connect(broker, user), await Connection.connect(broker, ADMIN)
    marker = uuid.uuid4().hex.encode()
    outcome = Outcome()

    async def on_read(msg) -> None:
        outcome.read.add(msg.subject)

    async def on_watch(msg) -> None:
        if msg.data == marker:
            outcome.published.add(msg.subject)
        if msg.reply and msg.subject in request:
            await admin.nc.publish(msg.reply, b"answer")

    await admin.nc.subscribe(">", cb=on_watch)
    await bus.flush(admin.nc)
    for subject in subscribe:
        await me.nc.subscribe(subject, cb=on_read)
    await bus.flush(me.nc)
    for subject in subscribe:
        await admin.nc.publish(_concrete(subject), b"from admin")
    for subject in publish:
        await me.nc.publish(subject, marker)
    await bus.flush(me.nc)

    async def ask(subject: str) -> None:
        try:
            await me.nc.request(subject, b"q", timeout=REQUEST_TIMEOUT_S)
            outcome.answered.add(subject)
        except nats.errors.TimeoutError:
            pass

    await asyncio.gather(*(ask(s) for s in request))
    await asyncio.sleep(SETTLE_S)
    outcome.denied_publish = me.denied("publish")
    own_inbox = inbox_prefix(user).lower()  # a worker may not read it: it sends no requests
    outcome.denied_subscription = {
        s for s in me.denied("subscription") if not s.startswith(own_inbox)
    }
    for client in (me, admin):
        await client.nc.close()
    return outcome


def _concrete(subject: str) -> str:
    """A subject a subscription to `subject` matches."""
    return subject.replace("*", "x").replace(">", "x")


def _lower(subjects) -> set[str]:
    return {s.lower() for s in subjects}


@pytest.mark.parametrize(
    ("attacker", "target"),
    [(a, t) for a in ATTACKERS for t in OWNED if t != a],
)
def test_a_credential_cannot_use_another_roles_subjects(broker, attacker, target):
    own, theirs = OWNED[attacker], OWNED[target]
    publish = {*(theirs.publish - own.publish), f"{inbox_prefix(target)}.forged-reply"}
    subscribe = theirs.subscribe - own.subscribe
    request = theirs.request - own.request

    got = asyncio.run(_attempt(broker, attacker, subscribe, publish, request))
    assert got.published == set(), "forged messages reached their subjects"
    assert got.read == set(), "read another role's messages"
    assert got.answered == set(), "got answers as another role's client"
    assert got.denied_publish == _lower(publish | request)
    assert got.denied_subscription == _lower(subscribe)


@pytest.mark.parametrize("attacker", ATTACKERS)
def test_wildcard_reads_are_refused(broker, attacker):
    wildcards = set(WILDCARDS) - OWNED[attacker].subscribe  # the scheduler reads all results
    got = asyncio.run(_attempt(broker, attacker, wildcards, (), ()))
    assert got.read == set()
    assert got.denied_subscription == _lower(wildcards)


@pytest.mark.parametrize("user", ATTACKERS)
def test_own_subjects_work(broker, user):
    """The control: each refusal above is specific, not a broken credential."""
    own = OWNED[user]
    got = asyncio.run(_attempt(broker, user, own.subscribe, own.publish, own.request))
    assert got.denied_publish == set() and got.denied_subscription == set()
    assert got.published == own.publish
    assert {_concrete(s) for s in own.subscribe} <= got.read  # and replies, on an inbox
    assert got.answered == own.request


@pytest.mark.parametrize("user", ATTACKERS)
def test_a_users_name_with_another_users_password_is_refused(broker, user):
    others = [u for u in ATTACKERS if u != user]
    options = broker.nats_options(user)["options"]

    async def run() -> None:
        for other in others:
            password = broker.nats_options(other)["options"].password
            forged = bus.ConnectOptions(user, password, tls_ca=options.tls_ca)
            with pytest.raises(nats.errors.Error, match="Authorization Violation"):
                await nats.connect(broker.nats_url, allow_reconnect=False, **forged.nats_kwargs())

    asyncio.run(run())
