"""The leader election's lock: a coordination.k8s.io/v1 Lease in the Kubernetes API.

The official client's own `LeaseLock` (kubernetes 37) never creates a missing Lease: it passes
`pretty=True` where its validated API takes a string, so every replica stands by forever. This
lock does what client-go's does:

- `get` reads the Lease and keeps it (its `resourceVersion` guards the next `update`);
- `create` creates it, and fails when another replica was first (409);
- `update` replaces the Lease read last, and fails on a conflict (409: it changed meanwhile),
  counting `leaseTransitions` when the holder changes.

Times cross between the election's records (`str(datetime)` of local wall-clock time, as
`kubernetes.aio.leaderelection` writes them) and the Lease's RFC 3339 micro-times in UTC.
"""

from __future__ import annotations

import datetime
import logging
import math

from kubernetes.aio.client import ApiClient, CoordinationV1Api, V1Lease, V1LeaseSpec, V1ObjectMeta
from kubernetes.aio.client.exceptions import ApiException
from kubernetes.aio.leaderelection.leaderelectionrecord import LeaderElectionRecord
from kubernetes.aio.leaderelection.resourcelock.baselock import BaseLock

log = logging.getLogger(__name__)


class KubernetesLeaseLock(BaseLock):
    def __init__(self, name: str, namespace: str, identity: str, api_client: ApiClient) -> None:
        super().__init__(name, namespace, identity)
        self.api = CoordinationV1Api(api_client=api_client)
        self._lease: V1Lease | None = None  # as last read or written

    async def get(
        self, name: str, namespace: str
    ) -> tuple[bool, LeaderElectionRecord] | tuple[bool, Exception] | tuple[bool, None]:
        try:
            lease = await self.api.read_namespaced_lease(name, namespace)
        except ApiException as exc:  # 404: the election creates it
            return False, exc
        self._lease = lease
        return True, record_of(lease.spec)

    async def create(
        self, name: str, namespace: str, election_record: LeaderElectionRecord
    ) -> bool:
        body = V1Lease(
            metadata=V1ObjectMeta(name=name),
            spec=spec_of(election_record, lease_transitions=0),
        )
        try:
            self._lease = await self.api.create_namespaced_lease(namespace, body)
        except ApiException as exc:
            log.warning("Lease %s/%s not created: %s %s", namespace, name, exc.status, exc.reason)
            return False
        return True

    async def update(self, name: str, namespace: str, updated_record: LeaderElectionRecord) -> bool:
        if self._lease is None:  # the election updates only a Lease it has read
            return False
        previous = self._lease.spec or V1LeaseSpec()
        transitions = previous.lease_transitions or 0
        if previous.holder_identity and previous.holder_identity != updated_record.holder_identity:
            transitions += 1
        body = V1Lease(
            metadata=self._lease.metadata,  # with the resourceVersion that was read
            spec=spec_of(updated_record, lease_transitions=transitions),
        )
        try:
            self._lease = await self.api.replace_namespaced_lease(name, namespace, body)
        except ApiException as exc:  # 409: changed since our last get
            log.warning("Lease %s/%s not updated: %s %s", namespace, name, exc.status, exc.reason)
            return False
        return True


def spec_of(record: LeaderElectionRecord, lease_transitions: int) -> V1LeaseSpec:
    """The Lease spec that states `record`."""
    return V1LeaseSpec(
        holder_identity=record.holder_identity,
        lease_duration_seconds=math.ceil(float(record.lease_duration or 0)),
        acquire_time=_micro_time(record.acquire_time),
        renew_time=_micro_time(record.renew_time),
        lease_transitions=lease_transitions,
    )


def record_of(spec: V1LeaseSpec | None) -> LeaderElectionRecord:
    """The election's record of a Lease spec (fields the Lease lacks stay None)."""
    if spec is None:
        return LeaderElectionRecord(None, None, None, None)
    duration = spec.lease_duration_seconds
    return LeaderElectionRecord(
        spec.holder_identity,
        None if duration is None else str(duration),
        _record_time(spec.acquire_time),
        _record_time(spec.renew_time),
    )


def _micro_time(record_time: str | None) -> datetime.datetime | None:
    """A record's local wall-clock time as an aware UTC datetime."""
    if record_time is None:
        return None
    return datetime.datetime.fromisoformat(record_time).astimezone(datetime.UTC)


def _record_time(micro_time: datetime.datetime | None) -> str | None:
    """A Lease time as the election writes its own: `str` of a naive local datetime."""
    if micro_time is None:
        return None
    if micro_time.tzinfo is None:  # the API's times are UTC
        micro_time = micro_time.replace(tzinfo=datetime.UTC)
    return str(micro_time.astimezone().replace(tzinfo=None))
