"""Leader election (services/scheduler/leader.py): the official client's asyncio election with
our watchdog, run by two candidates against a Lease store that implements the client's lock
interface (`get`/`create`/`update` with resource versions and conflicts, as the API server
does): in memory, and the file backend of `--leader-election-lock-dir`. Real time: the client
allows no period under 1 s."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from kubernetes.aio.client.exceptions import ApiException
from kubernetes.aio.leaderelection.leaderelectionrecord import LeaderElectionRecord
from kubernetes.aio.leaderelection.resourcelock.baselock import BaseLock

from services.scheduler.config import SchedulerServiceConfig
from services.scheduler.leader import (
    LeaderElectionError,
    LeaderElector,
    LeaderState,
    lock_from_config,
)
from services.scheduler.lease_file import FileLeaseLock
from shared.epochs import new_epoch, supersedes

LEASE, RENEW, RETRY = 3.0, 2.0, 1.0
NAME, NAMESPACE = "skiff-scheduler", "test"
SLACK = 1.5  # a loaded machine


class MemoryLease:
    """One Lease object of an API server: its spec and resource version."""

    def __init__(self) -> None:
        self.spec: dict[str, str | None] | None = None
        self.version = 0


class MemoryLeaseLock(BaseLock):
    """LeaseLock's interface on a `MemoryLease`; `broken` fails every call as an unreachable
    API server does, `hang` makes every call wait forever."""

    def __init__(self, lease: MemoryLease, identity: str) -> None:
        super().__init__(NAME, NAMESPACE, identity)
        self.lease = lease
        self.seen_version: int | None = None
        self.broken = self.hang = False

    async def _call(self) -> None:
        if self.hang:
            await asyncio.Event().wait()
        if self.broken:
            raise ApiException(503, "Service Unavailable")

    async def get(self, name, namespace):
        try:
            await self._call()
        except ApiException as exc:
            return False, exc
        if self.lease.spec is None:
            return False, ApiException(404, "Not Found", body=json.dumps({"code": 404}))
        self.seen_version = self.lease.version
        return True, LeaderElectionRecord(**self.lease.spec)

    async def create(self, name, namespace, election_record):
        await self._call()
        if self.lease.spec is not None:
            return False  # 409 AlreadyExists
        self._write(election_record)
        return True

    async def update(self, name, namespace, updated_record):
        await self._call()
        if self.seen_version != self.lease.version:
            return False  # 409 Conflict: changed since our get
        self._write(updated_record)
        return True

    def _write(self, record: LeaderElectionRecord) -> None:
        self.lease.spec = dict(vars(record))
        self.lease.version += 1


class Candidate:
    """A scheduler replica as far as the election goes: leading starts a new epoch."""

    def __init__(self, lock: BaseLock, fail_to_start: bool = False) -> None:
        self.lock = lock
        self.fail_to_start = fail_to_start
        self.epoch: str | None = None
        self.started_at: float | None = None
        self.stopped_at: float | None = None
        self.elector = LeaderElector(
            lock,
            lease_duration_s=LEASE,
            renew_deadline_s=RENEW,
            retry_period_s=RETRY,
            on_started_leading=self._lead,
            on_stopped_leading=self._stop,
        )
        self.task: asyncio.Task[None] | None = None

    async def _lead(self) -> None:
        if self.fail_to_start:
            raise ConnectionError("no NATS")
        self.epoch, self.started_at = new_epoch(), time.monotonic()

    def _stop(self, reason: str) -> None:
        self.stopped_at = time.monotonic()

    def start(self) -> Candidate:
        self.task = asyncio.create_task(self.elector.run())
        return self

    def kill(self) -> None:
        """As SIGKILL: no more renewals, no goodbye."""
        assert self.task is not None
        self.task.cancel()


async def until(check: Callable[[], bool], timeout_s: float) -> float:
    """Seconds until `check()` holds; fails after `timeout_s`."""
    t0 = time.monotonic()
    while not check():
        assert time.monotonic() - t0 < timeout_s, f"not within {timeout_s} s"
        await asyncio.sleep(0.02)
    return time.monotonic() - t0


def memory_locks(tmp_path: Path) -> Callable[[str], BaseLock]:
    lease = MemoryLease()
    return lambda identity: MemoryLeaseLock(lease, identity)


def file_locks(tmp_path: Path) -> Callable[[str], BaseLock]:
    return lambda identity: FileLeaseLock(str(tmp_path), NAME, NAMESPACE, identity)


@pytest.mark.parametrize("locks", [memory_locks, file_locks], ids=["memory", "file"])
def test_the_standby_takes_over_a_killed_leader_within_the_lease_with_a_new_epoch(tmp_path, locks):
    lock = locks(tmp_path)

    async def run() -> float:
        a = Candidate(lock("scheduler-a")).start()
        await until(lambda: a.elector.is_leader, RETRY + SLACK)
        b = Candidate(lock("scheduler-b")).start()
        await asyncio.sleep(LEASE + 2 * RETRY)  # a renews: b never leads
        assert a.elector.is_leader and b.elector.state is LeaderState.STANDBY
        assert b.started_at is None
        a.kill()
        takeover_s = await until(lambda: b.elector.is_leader, LEASE + 2 * RETRY + SLACK)
        assert a.stopped_at is None  # killed, not told
        assert a.epoch is not None and b.epoch is not None
        assert b.epoch > a.epoch and supersedes(b.epoch, a.epoch, current_silent=False)
        b.kill()
        return takeover_s

    takeover_s = asyncio.run(run())
    # not before a's last renewal (at most a retry period before the kill) has expired
    assert takeover_s >= LEASE - RETRY - 0.2, takeover_s


@pytest.mark.parametrize("failure", ["broken", "hang"])
def test_a_leader_that_cannot_renew_stops_within_the_renew_deadline_before_a_takeover(failure):
    lease = MemoryLease()

    async def run() -> tuple[float, float]:
        a = Candidate(MemoryLeaseLock(lease, "scheduler-a")).start()
        await until(lambda: a.elector.is_leader, RETRY + SLACK)
        b = Candidate(MemoryLeaseLock(lease, "scheduler-b")).start()
        await asyncio.sleep(RETRY + 0.5)
        setattr(a.lock, failure, True)  # a's API server is gone (or hangs); b's is fine
        t0 = time.monotonic()
        stop_s = await until(lambda: a.stopped_at is not None, RENEW + SLACK)
        assert a.elector.state is LeaderState.LOST
        await until(lambda: b.elector.is_leader, LEASE + 2 * RETRY + SLACK)
        assert a.task is not None
        await asyncio.wait_for(a.task, 1)  # a's run() ended: it never leads again
        assert b.started_at is not None and a.stopped_at is not None
        b.kill()
        return stop_s, b.started_at - t0

    stop_s, takeover_s = asyncio.run(run())
    assert stop_s <= RENEW + 0.5, stop_s
    assert takeover_s > stop_s  # never two leaders


def test_candidates_started_together_elect_exactly_one():
    lease = MemoryLease()

    async def run() -> None:
        candidates = [Candidate(MemoryLeaseLock(lease, f"scheduler-{i}")) for i in range(3)]
        for c in candidates:
            c.start()
        await asyncio.sleep(LEASE + 2 * RETRY)
        leaders = [c for c in candidates if c.elector.is_leader]
        assert len(leaders) == 1
        assert all(c.started_at is None for c in candidates if c not in leaders)
        assert lease.spec is not None and lease.spec["holder_identity"] == leaders[0].lock.identity
        assert lease.version >= LEASE / RETRY  # renewed all along
        for c in candidates:
            c.kill()

    asyncio.run(run())


def test_a_leader_that_cannot_start_its_scheduler_stops_leading():
    async def run() -> None:
        a = Candidate(MemoryLeaseLock(MemoryLease(), "scheduler-a"), fail_to_start=True)
        a.start()
        assert a.task is not None
        await asyncio.wait_for(a.task, RETRY + SLACK)
        assert a.elector.state is LeaderState.LOST and a.stopped_at is not None

    asyncio.run(run())


def test_file_lease_lock_refuses_conflicting_writes(tmp_path):
    async def run() -> None:
        x = FileLeaseLock(str(tmp_path), NAME, NAMESPACE, "x")
        y = FileLeaseLock(str(tmp_path), NAME, NAMESPACE, "y")
        found, error = await x.get(NAME, NAMESPACE)
        assert not found and isinstance(error, ApiException)
        assert json.loads(error.body)["code"] == 404
        record = LeaderElectionRecord("x", "3", "t0", "t0")
        assert await x.create(NAME, NAMESPACE, record)
        assert not await y.create(NAME, NAMESPACE, record)  # exists
        (_, seen_x), (_, seen_y) = await x.get(NAME, NAMESPACE), await y.get(NAME, NAMESPACE)
        assert vars(seen_x) == vars(seen_y) == vars(record)
        assert await x.update(NAME, NAMESPACE, LeaderElectionRecord("x", "3", "t0", "t1"))
        assert not await y.update(NAME, NAMESPACE, LeaderElectionRecord("y", "3", "t1", "t1"))
        _, now = await y.get(NAME, NAMESPACE)
        assert now.holder_identity == "x" and now.renew_time == "t1"
        assert await y.update(NAME, NAMESPACE, LeaderElectionRecord("y", "3", "t2", "t2"))

    asyncio.run(run())


def test_settings_and_lock_selection(tmp_path):
    with pytest.raises(ValueError, match="lease duration > renew deadline"):
        SchedulerServiceConfig(leader_election_lease_duration=4.0)  # renew deadline is 4
    with pytest.raises(ValueError, match="retry period >= 1"):
        SchedulerServiceConfig(leader_election_retry_period=0.5)
    assert SchedulerServiceConfig(subject_prefix="skiff.shard1").lease_name == (
        "skiff.shard1-scheduler"
    )
    with pytest.raises(LeaderElectionError, match="not a DNS subdomain"):
        lock_from_config(SchedulerServiceConfig(subject_prefix="Skiff_Prod"))
    on_file = SchedulerServiceConfig(leader_election_lock_dir=str(tmp_path))
    lock = lock_from_config(on_file)
    assert isinstance(lock, FileLeaseLock) and lock.name == "skiff-scheduler"
    assert lock.identity.startswith(f"{socket.gethostname()}_")
    named = dataclasses.replace(on_file, leader_election_identity="skiff-scheduler-7d9f-x2")
    first, again = lock_from_config(named).identity, lock_from_config(named).identity
    # the pod's name, unique per process: a restarted scheduler is a new candidate
    assert first.startswith("skiff-scheduler-7d9f-x2_") and again != first
    # outside a pod: a clear error, not a traceback from the client
    with pytest.raises(LeaderElectionError, match="no namespace for the Lease"):
        lock_from_config(SchedulerServiceConfig())
    with pytest.raises(LeaderElectionError, match="not in a Kubernetes pod"):
        lock_from_config(SchedulerServiceConfig(leader_election_namespace="skiff"))
