"""`python -m services.auth_callout.keygen DIR`: a new signing key for the auth callout, as the
files of a Secret: DIR/seed (the account nkey seed, mode 0600: `--signing-key-file`) and
DIR/issuer (its public key: nats-server's auth_callout issuer).

    kubectl create secret generic skiff-nats-callout --from-file=DIR
"""

from __future__ import annotations

import argparse
from pathlib import Path

from services.auth_callout import nats_jwt
from shared.nats_auth import write_private


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m services.auth_callout.keygen", description=__doc__)
    p.add_argument("dir", type=Path, help="where to write seed and issuer (created)")
    args = p.parse_args(argv)
    seed = nats_jwt.new_account_seed()
    args.dir.mkdir(parents=True, exist_ok=True)
    write_private(args.dir / "seed", seed)
    (args.dir / "issuer").write_text(nats_jwt.public_key(nats_jwt.key_pair(seed)))


if __name__ == "__main__":
    main()
