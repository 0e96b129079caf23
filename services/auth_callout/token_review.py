"""Service-account tokens checked by the API server's TokenReview (authentication.k8s.io/v1):
valid, unexpired, of a service account and pod that still exist, and meant for the NATS
audience. The callout's own service account needs `create` on `tokenreviews`.
"""

from __future__ import annotations

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
        return ReviewedToken(status.user.username or "", dict(status.user.extra or {}))

    return review


async def check_reviews(review: Reviewer) -> None:
    """Start-up check: the API server reviews tokens for us (a made-up token is refused, not
    failed); ReviewUnavailable otherwise."""
    try:
        await review("skiff-auth-callout-start-up-check")
    except Refused:
        return
