"""NATS JWTs (nats-io/jwt v2) as the auth callout exchanges them: `header.claims.signature`,
each part base64url without padding, the header `{"typ": "JWT", "alg": "ed25519-nkey"}`, the
signature ed25519 over `header.claims` by the nkey whose public key is the claims' `iss`.
`jti` is the base32 (unpadded) SHA-512/256 of the standard claims without it, as the Go
library computes it; `iat` is set at signing.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from typing import Any

import nacl.exceptions
import nacl.signing
import nkeys

HEADER = {"typ": "JWT", "alg": "ed25519-nkey"}
_STANDARD = ("aud", "exp", "jti", "iat", "iss", "name", "nbf", "sub")  # Go's field order
_PREFIXES = {
    "A": nkeys.PREFIX_BYTE_ACCOUNT,
    "U": nkeys.PREFIX_BYTE_USER,
    "N": nkeys.PREFIX_BYTE_SERVER,
}


class InvalidJwt(ValueError):
    """A token that is not a well-formed NATS JWT signed by its issuer."""


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def new_account_seed() -> str:
    """A fresh account nkey seed (`SA...`)."""
    seed: bytes = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_ACCOUNT)
    return seed.decode()


def key_pair(seed: str) -> nkeys.KeyPair:
    """The key pair of an nkey seed; ValueError when it is not one."""
    try:
        return nkeys.from_seed(seed.strip().encode())
    except Exception as exc:  # nkeys raises its own errors and binascii's
        raise ValueError(f"not an nkey seed ({type(exc).__name__})") from None


def public_key(pair: nkeys.KeyPair) -> str:
    return bytes(pair.public_key).decode()


def verify_key(public: str) -> nacl.signing.VerifyKey:
    """The ed25519 key of a public nkey (`A...`, `U...`, `N...`), its checksum checked."""
    try:
        raw = base64.b32decode(public + "=" * (-len(public) % 8))
    except ValueError:
        raise InvalidJwt(f"not a public nkey: {public!r}") from None
    if (
        len(raw) != 35
        or raw[0] != _PREFIXES.get(public[:1])
        or nkeys.crc16(bytearray(raw[:-2])) != int.from_bytes(raw[-2:], "little")
    ):
        raise InvalidJwt(f"not a public nkey: {public!r}")
    return nacl.signing.VerifyKey(raw[1:-2])


def jti(claims: dict[str, Any]) -> str:
    standard = {k: claims[k] for k in _STANDARD if k != "jti" and claims.get(k)}
    digest = hashlib.new("sha512_256", json.dumps(standard, separators=(",", ":")).encode())
    return base64.b32encode(digest.digest()).rstrip(b"=").decode()


def encode(claims: dict[str, Any], signer: nkeys.KeyPair) -> str:
    """Sign `claims` (with `iss`, `iat` and `jti` set here) as a NATS JWT."""
    claims = {**claims, "iss": public_key(signer), "iat": int(time.time())}
    claims["jti"] = jti(claims)
    head = f"{_b64(json.dumps(HEADER).encode())}.{_b64(json.dumps(claims).encode())}"
    return f"{head}.{_b64(signer.sign(head.encode()))}"


def decode(token: str, *, issuer_prefix: str) -> dict[str, Any]:
    """The claims of a NATS JWT whose signature verifies with its `iss`, an nkey starting
    with `issuer_prefix` (`N`: a server, `A`: an account); InvalidJwt otherwise."""
    parts = token.strip().split(".")
    if len(parts) != 3:
        raise InvalidJwt("a JWT has three parts")
    try:
        header = json.loads(_unb64(parts[0]))
        claims = json.loads(_unb64(parts[1]))
        signature = _unb64(parts[2])
    except ValueError as exc:
        raise InvalidJwt(f"malformed JWT: {exc}") from None
    if not isinstance(header, dict) or header.get("alg") != HEADER["alg"]:
        raise InvalidJwt(f"unexpected JWT header {header!r}")
    if not isinstance(claims, dict) or not str(claims.get("iss", "")).startswith(issuer_prefix):
        raise InvalidJwt(f"the JWT's issuer is not an {issuer_prefix}... nkey")
    try:
        verify_key(claims["iss"]).verify(f"{parts[0]}.{parts[1]}".encode(), signature)
    except nacl.exceptions.BadSignatureError:
        raise InvalidJwt("bad JWT signature") from None
    return claims
