"""Service accounts to roles, pods to ids."""

from __future__ import annotations

import pytest

from services.auth_callout.identity import POD_NAME, Refused, ReviewedToken, RoleMap
from shared.nats_auth import GATEWAY, SCHEDULER, WORKER, NatsUser

ROLES = RoleMap(gateways=("ns/gw",), schedulers=("ns/sched",), workers=("ns/wk", "ns/wk2@m1"))


def _token(account: str, *pods: str) -> ReviewedToken:
    namespace, name = account.split("/")
    return ReviewedToken(f"system:serviceaccount:{namespace}:{name}", {POD_NAME: list(pods)})


def test_each_role_gets_its_pod_as_id():
    assert ROLES.user_of(_token("ns/wk", "wk-0")) == NatsUser("wk-0", "", WORKER, ("wk-0",))
    assert ROLES.user_of(_token("ns/wk2", "wk2-0")) == NatsUser(
        "wk2-0", "", WORKER, ("wk2-0",), "m1"
    )
    assert ROLES.user_of(_token("ns/gw", "gw-a")) == NatsUser(
        "gw-a", "", GATEWAY, gateway_id="gw-a"
    )
    assert ROLES.user_of(_token("ns/sched", "s-0")) == NatsUser("s-0", "", SCHEDULER)


@pytest.mark.parametrize(
    ("token", "reason"),
    [
        (_token("other/wk", "p"), "no NATS role"),
        (_token("ns/unknown", "p"), "no NATS role"),
        (_token("ns/wk"), "bound to no pod"),
        (_token("ns/wk", "a", "b"), "bound to no pod"),
        (_token("ns/wk", "bad.pod"), "must match"),
        (ReviewedToken("alice", {}), "not a service account"),
    ],
)
def test_refused_tokens(token, reason):
    with pytest.raises(Refused, match=reason):
        ROLES.user_of(token)


def test_service_accounts_are_checked():
    with pytest.raises(ValueError, match="namespace/name"):
        RoleMap(gateways=("gw",))
    with pytest.raises(ValueError, match="one role"):
        RoleMap(gateways=("ns/a",), workers=("ns/a@p",))
