"""Leader election among the replicas of one shard's scheduler, on a coordination.k8s.io Lease.

The election is `kubernetes.aio.leaderelection` of the official client (asyncio, since
kubernetes 37), run as a task on the scheduler's own event loop: its Lease calls are awaited
HTTP requests, so it never blocks the loop, and its callbacks run on the loop that owns the
scheduler, with no thread to hand them over from (the thread-based `kubernetes.leaderelection`
would call back from a thread of its own). Around it:

- every call on the lock is bounded by the renew deadline, and a transport error counts as a
  failed try instead of ending the election;
- a watchdog: the leader counts as lost once no renewal begun within the last renew deadline
  has succeeded, whatever the library's loop is doing (say, a call hanging on a partitioned API
  server). A standby takes over only a lease duration after it last saw the Lease change, so
  the old leader has stopped by then (renew deadline < lease duration).

Only `services/scheduler/main.py` imports this module, and only with `--leader-election`: the
`kubernetes` package is the optional extra `skiff[k8s]`.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import re
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

from kubernetes.aio.client.exceptions import ApiException
from kubernetes.aio.leaderelection.electionconfig import Config
from kubernetes.aio.leaderelection.leaderelection import LeaderElection
from kubernetes.aio.leaderelection.leaderelectionrecord import LeaderElectionRecord
from kubernetes.aio.leaderelection.resourcelock.baselock import BaseLock

from services.scheduler.config import SchedulerServiceConfig

log = logging.getLogger("skiff.scheduler.leader")

SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
# A Lease's name is a DNS subdomain (RFC 1123): lower-case alphanumerics, '-' and '.'.
_LEASE_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


class LeaderElectionError(RuntimeError):
    """Leader election cannot start: a missing package, namespace or cluster."""


class LeaderState(enum.StrEnum):
    STANDBY = "standby"  # waiting for the Lease; serves nothing
    LEADING = "leading"  # holds and renews the Lease; the scheduler runs
    LOST = "lost"  # could not renew: stopped leading, never leads again


class LeaderElector:
    """One replica's part in the election: stand by until the Lease is ours, then await
    `on_started_leading` (start the scheduler, a new epoch) and renew; call
    `on_stopped_leading` at once when the Lease is lost (the scheduler exits: a replica that
    lost it starts over as a standby). `state` is what a readiness endpoint reads."""

    def __init__(
        self,
        lock: BaseLock,
        *,
        lease_duration_s: float,
        renew_deadline_s: float,
        retry_period_s: float,
        on_started_leading: Callable[[], Awaitable[None]],
        on_stopped_leading: Callable[[str], None],
    ) -> None:
        self.lock = _BoundedLock(lock, renew_deadline_s, self._renewed)
        self.lease_duration_s = lease_duration_s
        self.renew_deadline_s = renew_deadline_s
        self.retry_period_s = retry_period_s
        self._on_started_leading = on_started_leading
        self._on_stopped_leading = on_stopped_leading
        self.state = LeaderState.STANDBY
        self._renewed_at = float("-inf")  # time.monotonic() at which the last renewal began
        self._lost = asyncio.Event()
        self._leading: asyncio.Task[None] | None = None

    @property
    def is_leader(self) -> bool:
        return self.state is LeaderState.LEADING

    @property
    def identity(self) -> str:
        return self.lock.identity

    async def run(self) -> None:
        """Stand by, lead, and return once the Lease is lost (after `on_stopped_leading`);
        cancel it to leave the election without calling it."""
        config = Config(
            self.lock,
            self.lease_duration_s,
            self.renew_deadline_s,
            self.retry_period_s,
            onstarted_leading=self._lead,
            onstopped_leading=self._renew_failed,
        )
        log.info("%s stands by for Lease %s", self.identity, self.lock.name)
        election = asyncio.create_task(LeaderElection(config).run())
        lost = asyncio.create_task(self._lost.wait())
        try:
            await asyncio.wait({election, lost}, return_when=asyncio.FIRST_COMPLETED)
            error = election.exception() if election.done() else None
            if error is not None:
                self._lose(f"the election failed: {error!r}")
                raise error
        finally:
            for task in (election, lost, self._leading):
                if task is not None:
                    task.cancel()

    async def _lead(self) -> None:
        """The library's `onstarted_leading`, run as a task of its own while we lead."""
        self._leading = asyncio.current_task()
        self.state = LeaderState.LEADING
        log.info("%s leads (Lease %s)", self.identity, self.lock.name)
        watchdog = asyncio.create_task(self._watch())
        try:
            await self._on_started_leading()
            await watchdog
        except Exception:
            log.exception("could not start leading")
            self._lose("could not start leading")
        finally:
            watchdog.cancel()

    async def _watch(self) -> None:
        while (left := self._renewed_at + self.renew_deadline_s - time.monotonic()) > 0:
            await asyncio.sleep(left)
        self._lose(f"Lease {self.lock.name} not renewed for {self.renew_deadline_s:g} s")

    async def _renew_failed(self) -> None:
        self._lose(f"could not renew Lease {self.lock.name}")

    def _renewed(self, began: float) -> None:
        self._renewed_at = max(self._renewed_at, began)

    def _lose(self, reason: str) -> None:
        if self.state is LeaderState.LEADING:
            log.error("%s stops leading: %s", self.identity, reason)
            self.state = LeaderState.LOST
            self._on_stopped_leading(reason)
        self._lost.set()


class _BoundedLock(BaseLock):
    """`lock` with each call bounded by `timeout_s` and any failure a failed try; reports the
    start of every successful write (create or update: both make us the holder)."""

    def __init__(
        self, lock: BaseLock, timeout_s: float, on_written: Callable[[float], None]
    ) -> None:
        super().__init__(lock.name, lock.namespace, lock.identity)
        self.inner, self.timeout_s, self.on_written = lock, timeout_s, on_written

    async def get(
        self, name: str, namespace: str
    ) -> tuple[bool, LeaderElectionRecord] | tuple[bool, Exception] | tuple[bool, None]:
        try:
            async with asyncio.timeout(self.timeout_s):
                return await self.inner.get(name, namespace)
        except Exception as exc:  # the library reads .reason and .body of what it gets back
            return False, ApiException(reason=f"{type(exc).__name__}: {exc}")

    async def create(
        self, name: str, namespace: str, election_record: LeaderElectionRecord
    ) -> bool:
        return await self._write(self.inner.create(name, namespace, election_record))

    async def update(self, name: str, namespace: str, updated_record: LeaderElectionRecord) -> bool:
        return await self._write(self.inner.update(name, namespace, updated_record))

    async def _write(self, call: Awaitable[bool]) -> bool:
        began = time.monotonic()
        try:
            async with asyncio.timeout(self.timeout_s):
                written = await call
        except Exception as exc:
            log.warning("Lease %s: %s: %s", self.name, type(exc).__name__, exc)
            return False
        if written:
            self.on_written(began)
        return written


# ---- from the scheduler's settings ----------------------------------------------------------


def process_identity(name: str) -> str:
    """`name` (the chart passes the pod name; default: the host name) with a suffix unique to
    this process: a scheduler restarted in the same pod must not take its predecessor's Lease
    for its own and skip the lease duration that lets the predecessor's plans drain."""
    return f"{name or socket.gethostname()}_{uuid.uuid4().hex[:8]}"


def lock_from_config(config: SchedulerServiceConfig) -> BaseLock:
    """The Lease of `config`: in the Kubernetes API (in-cluster credentials), or a file of
    `leader_election_lock_dir` for tests and development."""
    name = config.lease_name
    if not _LEASE_NAME.match(name) or len(name) > 253:
        raise LeaderElectionError(
            f"Lease name {name!r} is not a DNS subdomain: set --leader-election-lease-name"
        )
    identity = process_identity(config.leader_election_identity)
    if config.leader_election_lock_dir:
        from services.scheduler.lease_file import FileLeaseLock

        namespace = config.leader_election_namespace or "local"
        return FileLeaseLock(config.leader_election_lock_dir, name, namespace, identity)
    return _kubernetes_lease_lock(name, _namespace(config), identity)


def _namespace(config: SchedulerServiceConfig) -> str:
    if config.leader_election_namespace:
        return config.leader_election_namespace
    try:
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
    except OSError as exc:
        raise LeaderElectionError(
            f"no namespace for the Lease ({exc}): set --leader-election-namespace"
        ) from exc


def _kubernetes_lease_lock(name: str, namespace: str, identity: str) -> BaseLock:
    from kubernetes.aio.client import ApiClient
    from kubernetes.aio.config import ConfigException, load_incluster_config

    from services.scheduler.lease_lock import KubernetesLeaseLock

    try:
        # the pod's service account (its rotating token is re-read as it changes)
        load_incluster_config()  # type: ignore[no-untyped-call]
    except ConfigException as exc:
        raise LeaderElectionError(f"not in a Kubernetes pod: {exc}") from exc
    return KubernetesLeaseLock(name, namespace, identity, ApiClient())


def elector_from_config(
    config: SchedulerServiceConfig,
    on_started_leading: Callable[[], Awaitable[None]],
    on_stopped_leading: Callable[[str], None],
) -> LeaderElector:
    return LeaderElector(
        lock_from_config(config),
        lease_duration_s=config.leader_election_lease_duration,
        renew_deadline_s=config.leader_election_renew_deadline,
        retry_period_s=config.leader_election_retry_period,
        on_started_leading=on_started_leading,
        on_stopped_leading=on_stopped_leading,
    )
