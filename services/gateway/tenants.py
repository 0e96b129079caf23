"""Tenants at run time: whose key a request carries, and whether their limits admit it.

Authentication: the SHA-256 of the presented bearer key is compared with every stored hash by
`hmac.compare_digest`, all of them whatever matches, so the time taken tells nothing about
which hash (if any) is close or which tenant matched; tenants are few (a file), so the loop
costs little next to the hash.

Limits, per tenant, over a minute: token buckets as in Envoy's local rate limit (a bucket of N
units refilled continuously at N per 60 s; a request needs one unit):
* `requests_per_minute`: every admitted request takes one unit;
* `tokens_per_minute`: a request is admitted while the bucket holds a unit; its prompt tokens
  are taken once the engine accepted it, its generated tokens as they come, so the bucket may
  go below zero (by one request's tokens) and the next requests wait until it refills;
* `max_concurrency`: requests being served, a stream until its last byte or its client left.
A refusal is a 429 whose `Retry-After` is the seconds until the bucket has a unit again (1 for
concurrency). Without any key every request is the unlimited admin tenant `anonymous`, so its
usage is still counted.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from services.gateway.errors import APIError
from services.gateway.key_file import ANONYMOUS, Tenant
from services.gateway.metrics import GatewayMetrics


class TokenBucket:
    """`per_minute` units, refilled continuously at `per_minute` per 60 s."""

    def __init__(self, per_minute: int, now: float) -> None:
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0  # units per second
        self.level = self.capacity
        self.updated = now

    def wait(self, now: float) -> float:
        """Seconds until the bucket holds one unit (0: it does now)."""
        return max(0.0, (1.0 - self.available(now)) / self.rate)

    def available(self, now: float) -> float:
        self._refill(now)
        return self.level

    def take(self, units: float, now: float) -> None:
        self._refill(now)
        self.level -= units

    def _refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
        self.updated = now


class Rejection(Exception):
    """A request the tenant's limits or rights refuse: an HTTP error, with Retry-After."""

    def __init__(
        self, status: int, outcome: str, message: str, retry_after: int | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.outcome = outcome  # the metrics' label
        self.message = message
        self.retry_after = retry_after  # seconds

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after is None else {"Retry-After": str(self.retry_after)}


@dataclass
class TenantState:
    """One tenant's buckets and requests in flight."""

    tenant: Tenant
    digest: bytes  # the key's SHA-256
    requests: TokenBucket | None
    tokens: TokenBucket | None
    in_flight: int = 0


@dataclass
class Ticket:
    """One admitted request of a tenant, from its admission to its last byte."""

    state: TenantState
    tenants: Tenants
    outcome: str | None = None  # a rejection after admission (model not allowed)

    @property
    def name(self) -> str:
        return self.state.tenant.name

    def allows(self, model: str) -> bool:
        return self.state.tenant.allows(model)

    def check_model(self, model: str) -> None:
        if not self.allows(model):
            self.outcome = "model_not_allowed"
            raise APIError(403, f"The model `{model}` is not allowed for this API key.", "model")

    def prompt_tokens(self, count: int) -> None:
        self.tenants.charge(self, "prompt", count)

    def generation_tokens(self, count: int) -> None:
        self.tenants.charge(self, "generation", count)


@dataclass
class Tenants:
    """Authenticates keys and admits requests of `tenants` (none: the anonymous tenant)."""

    tenants: list[Tenant]
    metrics: GatewayMetrics
    clock: Callable[[], float] = time.monotonic
    states: list[TenantState] = field(init=False)

    def __post_init__(self) -> None:
        now = self.clock()
        tenants = self.tenants or [Tenant(name=ANONYMOUS, key_sha256="0" * 64, admin=True)]
        self.states = [
            TenantState(
                t,
                bytes.fromhex(t.key_sha256),
                TokenBucket(t.requests_per_minute, now) if t.requests_per_minute else None,
                TokenBucket(t.tokens_per_minute, now) if t.tokens_per_minute else None,
            )
            for t in tenants
        ]

    @property
    def required(self) -> bool:
        """Whether requests need a key."""
        return bool(self.tenants)

    def authenticate(self, authorization: str) -> TenantState | None:
        """The tenant of an `Authorization: Bearer <key>` header (the anonymous one when no
        key is required), or None."""
        if not self.required:
            return self.states[0]
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key:
            return None
        digest = hashlib.sha256(key.encode("latin-1")).digest()
        found = None
        for state in self.states:  # no early exit: the same comparisons for every key
            if hmac.compare_digest(digest, state.digest):
                found = state
        return found

    def admit(self, state: TenantState, admin_route: bool) -> Ticket:
        """A ticket for one more request of this tenant, or `Rejection`."""
        try:
            self._check(state, admin_route)
        except Rejection as r:
            self.metrics.tenant_requests.labels(state.tenant.name, r.outcome).inc()
            raise
        if state.requests is not None:
            state.requests.take(1, self.clock())
        state.in_flight += 1
        self.metrics.tenant_in_flight.labels(state.tenant.name).inc()
        return Ticket(state, self)

    def release(self, ticket: Ticket, status: int) -> None:
        """The request's response ended (or its client left)."""
        name = ticket.name
        ticket.state.in_flight -= 1
        self.metrics.tenant_in_flight.labels(name).dec()
        outcome = ticket.outcome or ("ok" if status < 400 else "error")
        self.metrics.tenant_requests.labels(name, outcome).inc()

    def usage(self) -> list[dict[str, Any]]:
        """Each tenant's limits, requests in flight and units left in its buckets."""
        now = self.clock()
        return [
            {
                **s.tenant.model_dump(exclude={"key_sha256"}),
                "in_flight": s.in_flight,
                "requests_left": math.floor(s.requests.available(now)) if s.requests else None,
                "tokens_left": math.floor(s.tokens.available(now)) if s.tokens else None,
            }
            for s in self.states
        ]

    def charge(self, ticket: Ticket, kind: str, count: int) -> None:
        """`count` prompt or generated tokens of the ticket's tenant."""
        if count <= 0:
            return
        if ticket.state.tokens is not None:
            ticket.state.tokens.take(count, self.clock())
        self.metrics.tenant_tokens.labels(ticket.name, kind).inc(count)

    def _check(self, state: TenantState, admin_route: bool) -> None:
        t, now = state.tenant, self.clock()
        if admin_route and not t.admin:
            raise Rejection(403, "not_admin", "This route needs an admin API key.")
        limit = t.max_concurrency
        if limit is not None and state.in_flight >= limit:
            message = f"Too many concurrent requests for this API key (max_concurrency {limit})."
            raise Rejection(429, "max_concurrency", message, 1)
        for outcome, bucket, per_minute in (
            ("requests_per_minute", state.requests, t.requests_per_minute),
            ("tokens_per_minute", state.tokens, t.tokens_per_minute),
        ):
            wait = bucket.wait(now) if bucket is not None else 0.0
            if wait > 0:
                seconds = max(1, math.ceil(wait))
                message = (
                    f"Rate limit reached for this API key ({outcome} {per_minute}); "
                    f"try again in {seconds} s."
                )
                raise Rejection(429, outcome, message, seconds)


def ticket_of(request: Request) -> Ticket | None:
    """The ticket of a request on /v1/* or /admin/* (`TenantMiddleware` puts it there)."""
    ticket: Ticket | None = getattr(request.state, "tenant", None)
    return ticket
