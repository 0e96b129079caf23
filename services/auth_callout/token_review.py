"""Service-account tokens checked by the API server's TokenReview (authentication.k8s.io/v1):
valid, unexpired, of a service account and pod that still exist, and meant for the NATS
audience. The callout's own service account needs `create` on `tokenreviews`. A reviewed
token's expiry bounds the NATS user it gets.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Awaitable, Callable

from kubernetes.aio.client import (
    ApiClient,
    AuthenticationV1Api,
    V1TokenReview,
    V1TokenReviewSpec,
)
from kubernetes.aio.client.exceptions import ApiException

from services.auth_callout.identity import Refused, ReviewedToken

Reviewer = Callable[[str], Awaitable[ReviewedToken]]


class ReviewUnavailable(Exception):
    """The API server could not review a token (unreachable, or the review not allowed)."""


def token_reviewer(api: ApiClient, audience: str) -> Reviewer:
    """Review a token for `audience`: the reviewed token, or Refused; ReviewUnavailable when
    the API server does not answer the review."""
    authentication = AuthenticationV1Api(api)

    async def review(token: str) -> ReviewedToken:
        if not token:
            raise Refused("no token in the CONNECT (the client's nats_token_file)")
        body = V1TokenReview(spec=V1TokenReviewSpec(token=token, audiences=[audience]))
        try:
            result = await authentication.create_token_review(body)
        except ApiException as exc:
            raise ReviewUnavailable(f"TokenReview failed: {exc.status} {exc.reason}") from None
        except OSError as exc:
            raise ReviewUnavailable(f"API server unreachable: {exc}") from None
        status = result.status
        if status is None or not status.authenticated or status.user is None:
            error = status.error if status is not None else ""
            raise Refused(f"token not authenticated: {error or 'no reason given'}")
        if audience not in (status.audiences or ()):
            raise Refused(f"token not meant for the audience {audience!r}")
        user = status.user
        return ReviewedToken(user.username or "", dict(user.extra or {}), token_expiry(token))

    return review


def token_expiry(token: str) -> int:
    """The `exp` claim of a JWT the API server has just authenticated (0: none)."""
    parts = token.split(".")
    if len(parts) != 3:
        return 0
    try:
        claims = json.loads(base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)))
    except ValueError:
        return 0
    exp = claims.get("exp") if isinstance(claims, dict) else None
    return exp if isinstance(exp, int) and exp > 0 else 0


async def check_reviews(review: Reviewer) -> None:
    """Start-up check: the API server reviews tokens for us (a made-up token is refused, not
    failed); ReviewUnavailable otherwise."""
    try:
        await review("skiff-auth-callout-start-up-check")
    except Refused:
        return
