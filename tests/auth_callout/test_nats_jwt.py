"""NATS JWTs: encode, sign and verify round trip; a tampered or foreign token is refused."""

from __future__ import annotations

import base64
import json

import pytest

from services.auth_callout import claims, nats_jwt
from services.auth_callout.nats_jwt import InvalidJwt
from services.auth_callout.token_review import token_expiry
from shared.nats_auth import Permissions

SIGNER = nats_jwt.key_pair(nats_jwt.new_account_seed())
USER_NKEY = "U" + "A" * 55  # shape only: parse_request checks the prefix


def _b64url(value: object) -> str:
    return base64.urlsafe_b64encode(json.dumps(value).encode()).rstrip(b"=").decode()


def _request() -> claims.AuthRequest:
    return claims.AuthRequest("NSERVER", USER_NKEY, "tok", "client", "10.0.0.1")


def test_a_signed_jwt_verifies_with_its_issuer():
    token = nats_jwt.encode({"sub": "x", "nats": {"type": "user"}}, SIGNER)
    header, _body, _sig = token.split(".")
    assert json.loads(base64.urlsafe_b64decode(header + "==")) == nats_jwt.HEADER
    decoded = nats_jwt.decode(token, issuer_prefix="A")
    assert decoded["iss"] == nats_jwt.public_key(SIGNER) and decoded["iss"].startswith("A")
    assert decoded["sub"] == "x" and decoded["iat"] > 0
    assert decoded["jti"] == nats_jwt.jti(decoded)  # the hash of the standard claims


def test_a_tampered_or_foreign_jwt_is_refused():
    token = nats_jwt.encode({"sub": "x"}, SIGNER)
    header, body, sig = token.split(".")
    forged = json.loads(base64.urlsafe_b64decode(body + "=="))
    forged["sub"] = "y"
    forged_body = base64.urlsafe_b64encode(json.dumps(forged).encode()).rstrip(b"=").decode()
    with pytest.raises(InvalidJwt, match="signature"):
        nats_jwt.decode(f"{header}.{forged_body}.{sig}", issuer_prefix="A")
    with pytest.raises(InvalidJwt, match="issuer"):
        nats_jwt.decode(token, issuer_prefix="N")  # an account's, not a server's
    with pytest.raises(InvalidJwt):
        nats_jwt.decode("not.a-jwt", issuer_prefix="A")
    other = nats_jwt.key_pair(nats_jwt.new_account_seed())
    forged["iss"] = nats_jwt.public_key(other)  # claims another issuer, signed by ours
    forged_body = base64.urlsafe_b64encode(json.dumps(forged).encode()).rstrip(b"=").decode()
    with pytest.raises(InvalidJwt, match="signature"):
        nats_jwt.decode(f"{header}.{forged_body}.{sig}", issuer_prefix="A")


def test_public_nkeys_are_checksummed():
    public = nats_jwt.public_key(SIGNER)
    nats_jwt.verify_key(public)
    broken = public[:-1] + ("A" if public[-1] != "A" else "B")
    with pytest.raises(InvalidJwt):
        nats_jwt.verify_key(broken)
    with pytest.raises(ValueError, match="seed"):
        nats_jwt.key_pair("SAnot-a-seed")


def test_user_and_response_claims_follow_the_callout_protocol():
    perms = Permissions(publish=("a",), subscribe=("b", "c"), allow_responses=True)
    user = claims.user_claims(_request(), "w", perms, "SKIFF")
    assert user["aud"] == "SKIFF" and user["sub"] == USER_NKEY and user["name"] == "w"
    assert user["nats"]["pub"] == {"allow": ["a"]}
    assert user["nats"]["sub"] == {"allow": ["b", "c"]}
    assert user["nats"]["resp"] == {"max": 1, "ttl": 0}
    assert user["nats"]["type"] == "user" and user["nats"]["subs"] == -1
    assert "exp" not in user  # no expiry known: none
    assert (
        claims.user_claims(_request(), "w", perms, "SKIFF", 1_900_000_000)["exp"] == 1_900_000_000
    )
    response = claims.response_claims(_request(), jwt="J")
    assert response == {
        "aud": "NSERVER",
        "sub": USER_NKEY,
        "nats": {"type": "authorization_response", "version": 2, "jwt": "J"},
    }
    assert claims.response_claims(_request(), error="no")["nats"]["error"] == "no"
    with pytest.raises(ValueError):
        claims.response_claims(_request())


def test_a_request_needs_the_request_audience_and_type():
    body = {
        "aud": claims.REQUEST_AUDIENCE,
        "nats": {
            "type": "authorization_request",
            "server_id": {"id": "NSERVER"},
            "user_nkey": USER_NKEY,
            "connect_opts": {"auth_token": "tok", "name": "client"},
            "client_info": {"host": "10.0.0.1"},
        },
    }
    assert claims.parse_request(body) == _request()
    with pytest.raises(ValueError):
        claims.parse_request({**body, "aud": "other"})
    with pytest.raises(ValueError):
        claims.parse_request({**body, "nats": {**body["nats"], "type": "user"}})


def test_keygen_writes_a_seed_and_its_issuer(tmp_path):
    from services.auth_callout import keygen

    keygen.main([str(tmp_path / "key")])
    seed = (tmp_path / "key" / "seed").read_text()
    assert (tmp_path / "key" / "seed").stat().st_mode & 0o077 == 0
    issuer = (tmp_path / "key" / "issuer").read_text()
    assert seed.startswith("SA") and issuer == nats_jwt.public_key(nats_jwt.key_pair(seed))
    assert issuer.startswith("A") and len(issuer) == 56


@pytest.mark.parametrize(
    ("token", "expiry"),
    [
        ("h." + _b64url({"exp": 1_900_000_000, "sub": "x"}) + ".s", 1_900_000_000),
        ("h." + _b64url({"sub": "x"}) + ".s", 0),
        ("h." + _b64url({"exp": "soon"}) + ".s", 0),
        ("h." + _b64url([1]) + ".s", 0),
        ("h.not base64!.s", 0),
        ("worker:w", 0),
    ],
)
def test_a_reviewed_tokens_expiry_is_its_exp_claim(token, expiry):
    assert token_expiry(token) == expiry
