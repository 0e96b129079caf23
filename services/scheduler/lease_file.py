"""A Lease kept in a local file: the lock of `--leader-election-lock-dir`, for tests and
development only (schedulers on one host, no Kubernetes API).

It behaves as `KubernetesLeaseLock` (lease_lock.py) does against the API server: `get` reads
the Lease and remembers its resource version, `create` fails when the Lease exists, `update`
fails when the Lease changed since this lock's last `get` (a conflict), and every write bumps
the version.
Each operation holds an exclusive `flock` and replaces the file atomically.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kubernetes.aio.client.exceptions import ApiException
from kubernetes.aio.leaderelection.leaderelectionrecord import LeaderElectionRecord
from kubernetes.aio.leaderelection.resourcelock.baselock import BaseLock

NOT_FOUND = 404


class FileLeaseLock(BaseLock):
    def __init__(self, directory: str, name: str, namespace: str, identity: str) -> None:
        super().__init__(name, namespace, identity)
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._seen_version: int | None = None  # resource version of the last get

    def _path(self, name: str, namespace: str) -> Path:
        return self.directory / f"{namespace}.{name}.json"

    async def get(
        self, name: str, namespace: str
    ) -> tuple[bool, LeaderElectionRecord] | tuple[bool, Exception] | tuple[bool, None]:
        lease = await asyncio.to_thread(self._locked_read, self._path(name, namespace))
        if lease is None:
            not_found = ApiException(NOT_FOUND, "Not Found", body=json.dumps({"code": NOT_FOUND}))
            return False, not_found
        self._seen_version = lease["resourceVersion"]
        return True, LeaderElectionRecord(
            lease["holderIdentity"],
            lease["leaseDurationSeconds"],
            lease["acquireTime"],
            lease["renewTime"],
        )

    async def create(
        self, name: str, namespace: str, election_record: LeaderElectionRecord
    ) -> bool:
        return await asyncio.to_thread(
            self._write, self._path(name, namespace), election_record, None
        )

    async def update(self, name: str, namespace: str, updated_record: LeaderElectionRecord) -> bool:
        if self._seen_version is None:
            return False
        return await asyncio.to_thread(
            self._write, self._path(name, namespace), updated_record, self._seen_version
        )

    def _locked_read(self, path: Path) -> dict[str, Any] | None:
        with _flock(path):
            return _read(path)

    def _write(self, path: Path, record: LeaderElectionRecord, expected: int | None) -> bool:
        """Write `record` if the Lease is at version `expected` (None: if there is none)."""
        with _flock(path):
            current = _read(path)
            version = None if current is None else current["resourceVersion"]
            if version != expected:
                return False  # exists (create) or changed since our get (update): a conflict
            new_version = (version or 0) + 1
            lease = {
                "holderIdentity": record.holder_identity,
                "leaseDurationSeconds": record.lease_duration,
                "acquireTime": record.acquire_time,
                "renewTime": record.renew_time,
                "resourceVersion": new_version,
            }
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(lease))
            os.replace(tmp, path)
        self._seen_version = new_version
        return True


def _read(path: Path) -> dict[str, Any] | None:
    try:
        lease: dict[str, Any] = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    return lease


@contextmanager
def _flock(path: Path) -> Iterator[None]:
    with open(path.with_suffix(".lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield  # released when the file is closed
