"""One auth callout exchange: the server's signed request in, the signed response out (a user
JWT with the permissions of the token's role and pod, or the error that refuses the client)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import nkeys

from services.auth_callout import claims, nats_jwt
from services.auth_callout.identity import Refused, RoleMap
from services.auth_callout.token_review import Reviewer, ReviewUnavailable
from shared.nats_auth import ModelSubjects, permissions

log = logging.getLogger("skiff.auth_callout")


@dataclass(frozen=True)
class Authorizer:
    """Admits the clients whose tokens `review` accepts and `roles` maps, into `account`, with
    `shared.nats_auth.permissions` on the deployment's subjects, until their tokens expire."""

    roles: RoleMap
    review: Reviewer
    signer: nkeys.KeyPair
    prefix: str
    num_shards: int
    models: Sequence[ModelSubjects] = ()
    account: str = "SKIFF"

    async def answer(self, request_jwt: str) -> str | None:
        """The response JWT; None for a request that does not verify (left unanswered: the
        server refuses the client when its auth timeout passes)."""
        try:
            request = claims.parse_request(nats_jwt.decode(request_jwt, issuer_prefix="N"))
        except ValueError as exc:
            log.warning("ignoring a malformed authorization request: %s", exc)
            return None
        try:
            token = await self.review(request.token)
            user = self.roles.user_of(token)
            perms = permissions(user, self.prefix, self.num_shards, self.models)
        except (Refused, ReviewUnavailable, ValueError) as exc:
            log.warning("refused %s (%s): %s", request.client_name, request.client_host, exc)
            return self._sign(claims.response_claims(request, error=str(exc)))
        assert perms is not None  # no token maps to admin
        user_jwt = self._sign(
            claims.user_claims(request, user.name, perms, self.account, token.expires_at)
        )
        log.info("admitted %s as %s %s", request.client_host, user.role, user.name)
        return self._sign(claims.response_claims(request, jwt=user_jwt))

    def _sign(self, body: dict[str, object]) -> str:
        return nats_jwt.encode(body, self.signer)
