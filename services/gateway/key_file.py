"""The gateway's API key file: one entry per tenant, keys stored as their SHA-256, never in clear.

    {"tenants": [
      {"name": "team-a",               # metric label and log name: letters, digits, . _ -
       "key_sha256": "9f86d08188...",  # skiff hash-key, or: printf %s "$KEY" | sha256sum
       "requests_per_minute": 600,     # each limit is optional (absent: unlimited)
       "tokens_per_minute": 200000,    # prompt + generated tokens
       "max_concurrency": 8,           # requests being served at once, streams included
       "models": ["SmolLM2-135M-Instruct"],  # optional allow-list (absent: every model)
       "admin": false}                 # may call /admin/* routes
    ]}

JSON (the standard library reads it: no YAML dependency in the gateway image; `yq -o=json`
converts YAML). `--api-key` still works: it is the unlimited admin tenant `default`.
`skiff hash-key` reads a key on stdin and prints its hash.
"""

from __future__ import annotations

import getpass
import hashlib
import json
import sys
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

DEFAULT_TENANT = "default"  # the tenant of --api-key
ANONYMOUS = "anonymous"  # the tenant of every request when no key is required
TENANT_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"


class KeyFileError(ValueError):
    """A key file that cannot be used; the message is one line naming what to fix."""


class Tenant(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Annotated[str, Field(pattern=TENANT_NAME)]
    key_sha256: Annotated[str, Field(pattern=r"^[0-9a-fA-F]{64}$")]
    requests_per_minute: Annotated[int, Field(ge=1)] | None = None
    tokens_per_minute: Annotated[int, Field(ge=1)] | None = None
    max_concurrency: Annotated[int, Field(ge=1)] | None = None
    models: tuple[str, ...] | None = None
    admin: bool = False

    @field_validator("key_sha256")
    @classmethod
    def _lower(cls, value: str) -> str:
        return value.lower()

    def allows(self, model: str) -> bool:
        return self.models is None or model in self.models


class KeyFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenants: Annotated[list[Tenant], Field(min_length=1)]


def hash_key(key: str | bytes) -> str:
    """The hex SHA-256 of a key (UTF-8), as the key file stores it."""
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).hexdigest()


def load_key_file(path: str) -> list[Tenant]:
    """The tenants of a key file; `KeyFileError` (one line) when it is missing or malformed."""
    where = f"API key file {path}"
    try:
        data = json.loads(Path(path).read_bytes())
    except OSError as e:
        raise KeyFileError(f"{where}: cannot read it ({e.strerror or e})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise KeyFileError(f"{where}: not valid JSON ({e})") from None
    try:
        tenants = KeyFile.model_validate(data).tenants
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "the file"
        hint = " (the hex SHA-256 of the key: skiff hash-key)" if "key_sha256" in field else ""
        raise KeyFileError(f"{where}: {field}: {first['msg']}{hint}") from None
    return tenants


def tenants_of(api_key: str | None, api_keys_file: str | None) -> list[Tenant]:
    """Every tenant the gateway knows: the key file's, and `default` for `--api-key`.
    Names and key hashes must be unique. Empty: no authentication."""
    tenants = load_key_file(api_keys_file) if api_keys_file else []
    if api_key:
        tenants.append(Tenant(name=DEFAULT_TENANT, key_sha256=hash_key(api_key), admin=True))
    names, hashes, where = set(), set(), f"API key file {api_keys_file}"
    for t in tenants:
        if t.name in names:
            raise KeyFileError(f"{where}: tenant name {t.name!r} is used twice (or by --api-key)")
        if t.key_sha256 in hashes:
            raise KeyFileError(f"{where}: tenant {t.name!r} has the key of another tenant")
        names.add(t.name)
        hashes.add(t.key_sha256)
    return tenants


def hash_key_main(argv: list[str]) -> int:
    """`skiff hash-key`: the SHA-256 of the key on stdin (prompted for on a terminal)."""
    if argv:
        print("usage: skiff hash-key < key-file  (prints the key's SHA-256)", file=sys.stderr)
        return 2
    key = getpass.getpass("API key: ") if sys.stdin.isatty() else sys.stdin.read()
    key = key.removesuffix("\n")
    if not key:
        print("skiff hash-key: empty key", file=sys.stderr)
        return 1
    print(hash_key(key))
    return 0
