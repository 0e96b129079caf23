"""Who a reviewed Kubernetes service-account token is on NATS: its service account gives the
role (each role's accounts are configured), the pod it is bound to gives the id. A worker's
worker id and a gateway's gateway id are its pod name, and so is every user's name (its
request-reply inboxes are `_INBOX.<pod name>.*`); a token bound to no pod is refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shared.nats_auth import GATEWAY, SCHEDULER, WORKER, NatsUser

SERVICE_ACCOUNT_USER = "system:serviceaccount:"
POD_NAME = "authentication.kubernetes.io/pod-name"  # TokenReview status.user.extra


class Refused(Exception):
    """A token that gets no NATS user; the message says why (it reaches the server's log)."""


@dataclass(frozen=True)
class ReviewedToken:
    """A token the API server authenticated: its user name, extra fields and expiry (Unix
    seconds; 0: none known)."""

    username: str
    extra: Mapping[str, Sequence[str]]
    expires_at: int = 0


def service_account(spec: str) -> str:
    """`namespace/name` checked; ValueError otherwise."""
    namespace, sep, name = spec.partition("/")
    if not (sep and namespace and name) or "/" in name:
        raise ValueError(f"a service account is namespace/name, got {spec!r}")
    return spec


@dataclass(frozen=True)
class RoleMap:
    """Service accounts (`namespace/name`) by role; a worker account may carry its model's
    subject prefix (`namespace/name@PREFIX`; default: the first model's)."""

    gateways: tuple[str, ...] = ()
    schedulers: tuple[str, ...] = ()
    workers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        accounts = [*self.gateways, *self.schedulers, *(w.partition("@")[0] for w in self.workers)]
        for account in accounts:
            service_account(account)
        if len(set(accounts)) != len(accounts):
            raise ValueError("a service account may have one role only")

    def role_of(self, account: str) -> tuple[str, str] | None:
        """(role, worker prefix) of a service account, None when it has no role."""
        if account in self.gateways:
            return GATEWAY, ""
        if account in self.schedulers:
            return SCHEDULER, ""
        for spec in self.workers:
            name, _, prefix = spec.partition("@")
            if name == account:
                return WORKER, prefix
        return None

    def user_of(self, token: ReviewedToken) -> NatsUser:
        """The NATS user of a reviewed token (its password unused); Refused otherwise."""
        if not token.username.startswith(SERVICE_ACCOUNT_USER):
            raise Refused(f"{token.username!r} is not a service account")
        account = token.username.removeprefix(SERVICE_ACCOUNT_USER).replace(":", "/", 1)
        role = self.role_of(account)
        if role is None:
            raise Refused(f"service account {account} has no NATS role")
        pods = list(token.extra.get(POD_NAME, ()))
        if len(pods) != 1:
            raise Refused(f"the token of {account} is bound to no pod")
        pod = pods[0]
        kind, prefix = role
        try:
            if kind == WORKER:
                return NatsUser(pod, "", WORKER, (pod,), prefix)
            return NatsUser(pod, "", kind, gateway_id=pod if kind == GATEWAY else "")
        except ValueError as exc:
            raise Refused(str(exc)) from None
