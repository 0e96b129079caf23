"""The Lease lock's translation between election records and Lease specs (its calls against a
real API server are tested in tests/cluster/test_lease_lock.py)."""

from __future__ import annotations

import datetime

import pytest
from kubernetes.aio.leaderelection.leaderelectionrecord import LeaderElectionRecord

from services.scheduler.lease_lock import record_of, spec_of

pytestmark = pytest.mark.unit


def test_a_record_survives_the_round_trip_through_a_lease_spec():
    now = datetime.datetime.fromtimestamp(1_790_000_000.25)  # as the election writes it
    record = LeaderElectionRecord("sched-0-17", "4", str(now), str(now))
    spec = spec_of(record, lease_transitions=3)
    assert spec.holder_identity == "sched-0-17"
    assert spec.lease_duration_seconds == 4
    assert spec.lease_transitions == 3
    assert spec.renew_time == now.astimezone(datetime.UTC)
    assert record_of(spec).__dict__ == record.__dict__


def test_a_fractional_lease_duration_rounds_up_to_whole_seconds():
    now = str(datetime.datetime.now())
    assert spec_of(LeaderElectionRecord("a", "2.5", now, now), 0).lease_duration_seconds == 3


def test_a_lease_without_spec_fields_is_an_incomplete_record():
    record = record_of(None)
    assert (record.holder_identity, record.renew_time) == (None, None)
