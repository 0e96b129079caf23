"""The claims of the auth callout exchange (nats-io/jwt v2): the server's authorization
request, the user JWT the callout issues, and the authorization response that carries it or
an error.

In nats-server's configured (not operator) mode the user JWT's `aud` names the account the
user lands in, its `sub` is the user nkey the server generated for the connection (the
request's `user_nkey`), and its `name` becomes the connection's user name. The response's
`sub` is that same nkey and its `aud` the requesting server's id, so a response answers one
connection on one server only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shared.nats_auth import Permissions

REQUEST_AUDIENCE = "nats-authorization-request"
REQUEST_TYPE, RESPONSE_TYPE, USER_TYPE = "authorization_request", "authorization_response", "user"
NO_LIMIT = -1
VERSION = 2


@dataclass(frozen=True)
class AuthRequest:
    """What the callout needs of an authorization request."""

    server_id: str
    user_nkey: str
    token: str  # the CONNECT's auth_token ("" when none)
    client_name: str
    client_host: str


def parse_request(claims: dict[str, Any]) -> AuthRequest:
    """The request in verified request claims; ValueError when they are not one."""
    nats = claims.get("nats")
    if claims.get("aud") != REQUEST_AUDIENCE or not isinstance(nats, dict):
        raise ValueError("not an authorization request")
    if nats.get("type") != REQUEST_TYPE:
        raise ValueError(f"not an authorization request: type {nats.get('type')!r}")
    server, connect, client = (
        nats.get(k) or {} for k in ("server_id", "connect_opts", "client_info")
    )
    user_nkey = nats.get("user_nkey", "")
    if not server.get("id") or not str(user_nkey).startswith("U"):
        raise ValueError("an authorization request needs server_id.id and user_nkey")
    return AuthRequest(
        server["id"],
        user_nkey,
        connect.get("auth_token", ""),
        connect.get("name", ""),
        client.get("host", ""),
    )


def user_claims(
    request: AuthRequest, name: str, perms: Permissions, account: str, expires_at: int = 0
) -> dict[str, Any]:
    """A user JWT's claims: `perms` in `account`, no limits on subscriptions or data; with
    `expires_at` (Unix seconds), nats-server ends the connection then."""
    nats: dict[str, Any] = {
        "pub": {"allow": list(perms.publish)},
        "sub": {"allow": list(perms.subscribe)},
        "subs": NO_LIMIT,
        "data": NO_LIMIT,
        "payload": NO_LIMIT,
        "type": USER_TYPE,
        "version": VERSION,
    }
    if perms.allow_responses:
        nats["resp"] = {"max": 1, "ttl": 0}  # one reply per request, the server's default expiry
    body: dict[str, Any] = {"aud": account, "name": name, "sub": request.user_nkey, "nats": nats}
    if expires_at:
        body["exp"] = expires_at
    return body


def response_claims(request: AuthRequest, *, jwt: str = "", error: str = "") -> dict[str, Any]:
    """The authorization response: the user JWT, or the error that refuses the connection."""
    if bool(jwt) == bool(error):
        raise ValueError("a response carries a user JWT or an error")
    nats: dict[str, Any] = {"type": RESPONSE_TYPE, "version": VERSION}
    nats.update({"jwt": jwt} if jwt else {"error": error})
    return {"aud": request.server_id, "sub": request.user_nkey, "nats": nats}
