"""NATS users of a deployment and what each may publish and subscribe, derived from
`shared.subjects`; renders nats-server's configuration (users, permissions, TLS, cluster
routes).

Roles: `admin` (operators and tests: everything), `gateway`, `scheduler` (every shard) and one
`worker` user per worker process, allowed only its own workers' plans and to publish only as
its own workers (hello, heartbeat, goodbye and results on subjects of their ids). A deployment
serving several models has one subject prefix (and shard count) per model (`ModelSubjects`):
the gateway and scheduler users get the subjects of every model, a worker user those of its
own model. Each user's request-reply inboxes are `_INBOX.<user>.*` (`inbox_prefix`), readable by
that user alone; a scheduler may answer requests (`allow_responses`) without publishing on
anyone's inbox.

A gateway user may be scoped to its own gateway id (`NatsUser.gateway_id`): it then reads
only its own outputs. Instead of static users, nats-server may hand authentication to `skiff
auth-callout` (`AuthCallout`), which admits each pod with the permissions of its role and own
id computed here; only `admin` stays a static user then.

`python -m shared.nats_auth` writes the configuration for a nats-server of its own (the Helm
chart runs it in an init container); `Stack.start_nats` calls `server_config` directly.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from shared.config import DEFAULT_SUBJECT_PREFIX
from shared.subjects import ANY_WORKER, SUBJECT_TOKEN, Subjects, shard_prefixes, worker_prefix

ADMIN, GATEWAY, SCHEDULER, WORKER = "admin", "gateway", "scheduler", "worker"
ROLES = (ADMIN, GATEWAY, SCHEDULER, WORKER)
ROUTE_USER = "route"  # the cluster routes' user (not a client user: routes authorize apart)
CALLOUT_USER = "auth-callout"  # `skiff auth-callout`'s own user, in AUTH_ACCOUNT
AUTH_ACCOUNT = "AUTH"  # the callout's account
CLIENT_ACCOUNT = "SKIFF"  # the account of every client the callout admits, and of `admin`
# The callout's heartbeats (`CalloutHeartbeat`) to every client: exported from AUTH_ACCOUNT to
# CLIENT_ACCOUNT, readable by every role (`shared.callout_watch`).
CALLOUT_HEARTBEAT = "skiff-auth-callout.heartbeat"


def inbox_prefix(user: str) -> str:
    """The prefix of `user`'s request-reply inboxes."""
    return f"_INBOX.{user}"


def new_password() -> str:
    return secrets.token_urlsafe(24)


@dataclass(frozen=True)
class NatsUser:
    """One NATS user; a worker user hosts `worker_ids` (several for simulated workers)."""

    name: str
    password: str
    role: str
    worker_ids: tuple[str, ...] = ()
    prefix: str = ""  # a worker's model's subject prefix ("": the first model's)
    gateway_id: str = ""  # a gateway scoped to its own outputs ("": every gateway's)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"unknown role {self.role!r}, expected one of {', '.join(ROLES)}")
        for token in (self.name, *self.worker_ids):  # a wildcard here would widen permissions
            if not SUBJECT_TOKEN.fullmatch(token):
                raise ValueError(f"user names and worker ids must match [A-Za-z0-9_-]+: {token!r}")
        if (self.role == WORKER) != bool(self.worker_ids):
            raise ValueError(f"user {self.name!r}: worker ids belong to (and only to) workers")
        if self.gateway_id and (
            self.role != GATEWAY or not SUBJECT_TOKEN.fullmatch(self.gateway_id)
        ):
            raise ValueError(
                f"user {self.name!r}: a gateway id belongs to a gateway, [A-Za-z0-9_-]+"
            )


@dataclass(frozen=True)
class ModelSubjects:
    """The subjects of one model's scheduler shards and workers."""

    prefix: str
    num_shards: int = 1


@dataclass(frozen=True)
class Permissions:
    """Subjects a user may publish to and subscribe to (everything else is denied)."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool = False


def _unique(*subjects: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(subjects))


def permissions(
    user: NatsUser, prefix: str, num_shards: int, models: Sequence[ModelSubjects] = ()
) -> Permissions | None:
    """What `user` may do on a deployment with this prefix and shard count, and the `models`
    served beside it on prefixes of their own (None: anything)."""
    deployments = [ModelSubjects(prefix, num_shards), *models]
    if user.role == ADMIN:
        return None
    if user.role == WORKER:
        own = next((m for m in deployments if m.prefix == (user.prefix or prefix)), None)
        if own is None:
            raise ValueError(f"worker user {user.name!r}: no model has prefix {user.prefix!r}")
        return _worker_permissions(user, own)
    parts = [_service_permissions(user, m) for m in deployments]
    return Permissions(
        publish=_unique(*(x for p in parts for x in p.publish)),
        subscribe=_unique(
            *(x for p in parts for x in p.subscribe),
            f"{inbox_prefix(user.name)}.>",
            CALLOUT_HEARTBEAT,
        ),
        allow_responses=user.role == SCHEDULER,  # submit, adapter and stats replies
    )


def _service_permissions(user: NatsUser, model: ModelSubjects) -> Permissions:
    """A gateway's or scheduler's subjects on one model's prefix (its inbox apart)."""
    shards = [Subjects(p) for p in shard_prefixes(model.prefix, model.num_shards)]
    # Gateway heartbeats: on every shard's prefix and the model's own.
    gateway_beats = _unique(*(s.gateway_heartbeat for s in [Subjects(model.prefix), *shards]))
    if user.role == GATEWAY:
        return Permissions(
            publish=_unique(
                *(x for s in shards for x in (s.submit, s.abort, s.lora_adapters)), *gateway_beats
            ),
            subscribe=_unique(
                *(
                    x
                    for s in shards
                    for x in (s.output(user.gateway_id or "*"), s.scheduler_heartbeat)
                )
            ),
        )
    return Permissions(
        publish=_unique(
            *(
                x
                for s in shards
                for x in (s.output("*"), s.plan("*"), s.lora_check("*"), s.scheduler_heartbeat)
            )
        ),
        subscribe=_unique(
            *(
                x
                for s in shards
                for x in (
                    s.submit,
                    s.abort,
                    s.lora_adapters,
                    s.worker_hello(ANY_WORKER),
                    s.worker_heartbeat(ANY_WORKER),
                    s.worker_goodbye(ANY_WORKER),
                    s.result(ANY_WORKER),
                    s.scheduler_stats,
                )
            ),
            *gateway_beats,
        ),
    )


def _worker_permissions(user: NatsUser, model: ModelSubjects) -> Permissions:
    own = [(Subjects(worker_prefix(model.prefix, w, model.num_shards)), w) for w in user.worker_ids]
    return Permissions(
        publish=_unique(  # only as its own workers
            *(
                x
                for s, w in own
                for x in (
                    s.worker_hello(w),
                    s.worker_heartbeat(w),
                    s.worker_goodbye(w),
                    s.result(w),
                )
            )
        ),
        # its scheduler's heartbeats keep an idle worker on the current epoch
        subscribe=_unique(
            *(x for s, w in own for x in (s.plan(w), s.lora_check(w), s.scheduler_heartbeat)),
            CALLOUT_HEARTBEAT,
        ),
        allow_responses=True,  # LoRA check replies
    )


def authorization_block(
    users: list[NatsUser], prefix: str, num_shards: int, models: Sequence[ModelSubjects] = ()
) -> str:
    """nats-server's `authorization { users = [...] }` for these users (`permissions`)."""
    if len({u.name for u in users}) != len(users):
        raise ValueError("user names must be unique")
    entries = []
    for user in users:
        entry: dict[str, object] = {"user": user.name, "password": user.password}
        perms = permissions(user, prefix, num_shards, models)
        if perms is not None:
            rules: dict[str, object] = {
                "publish": {"allow": list(perms.publish)},
                "subscribe": {"allow": list(perms.subscribe)},
            }
            if perms.allow_responses:
                rules["allow_responses"] = True
            entry["permissions"] = rules
        entries.append(entry)
    return f"authorization {json.dumps({'users': entries}, indent=2)}\n"


@dataclass(frozen=True)
class ServerTls:
    """TLS of a nats-server: its certificate and key; `ca` also makes it verify client
    certificates (mutual TLS)."""

    cert: str
    key: str
    ca: str = ""

    def block(self) -> str:
        tls: dict[str, object] = {"cert_file": self.cert, "key_file": self.key}
        if self.ca:
            tls.update(ca_file=self.ca, verify=True)
        return f"tls {json.dumps(tls)}\n"


@dataclass(frozen=True)
class Cluster:
    """The routes between the servers of a NATS cluster: every server's route URL (its own
    included: a server skips itself), TLS both ways (each server presents `tls.cert` and
    verifies its peers' with `tls.ca`), and the password of `ROUTE_USER`, which every server
    requires of the routes it accepts and presents on those it opens."""

    name: str
    routes: tuple[str, ...]
    listen: str = "0.0.0.0:6222"
    tls: ServerTls | None = None
    password: str = ""  # empty: routes without credentials

    def __post_init__(self) -> None:
        if self.tls is not None and not self.tls.ca:
            raise ValueError("route TLS needs the CA that signed the servers' certificates")

    def _route(self, url: str) -> str:
        if not self.password:
            return url
        parts = urllib.parse.urlsplit(url)
        secret = urllib.parse.quote(self.password, safe="")
        return parts._replace(netloc=f"{ROUTE_USER}:{secret}@{parts.netloc}").geturl()

    def block(self) -> str:
        cluster: dict[str, object] = {
            "name": self.name,
            "listen": self.listen,
            "routes": [self._route(url) for url in self.routes],
        }
        if self.tls is not None:
            cluster["tls"] = {
                "cert_file": self.tls.cert,
                "key_file": self.tls.key,
                "ca_file": self.tls.ca,
                "verify": True,
            }
        if self.password:
            cluster["authorization"] = {"user": ROUTE_USER, "password": self.password}
        return f"cluster {json.dumps(cluster, indent=2)}\n"


@dataclass(frozen=True)
class AuthCallout:
    """nats-server delegating authentication to `skiff auth-callout` (NATS auth callout): the
    callout's user answers `$SYS.REQ.USER.AUTH` with user JWTs signed by the account nkey
    whose public key is `issuer`; the users it admits land in CLIENT_ACCOUNT, beside the static
    `admin` (operators and tests), which skips the callout as the callout's own user does."""

    issuer: str
    callout_password: str
    admin_password: str

    def __post_init__(self) -> None:
        if not (self.issuer.startswith("A") and len(self.issuer) == 56):
            raise ValueError(
                f"the auth callout issuer must be an account public nkey (A...): {self.issuer!r}"
            )

    def block(self) -> str:
        accounts = {
            AUTH_ACCOUNT: {
                "users": [{"user": CALLOUT_USER, "password": self.callout_password}],
                "exports": [{"stream": CALLOUT_HEARTBEAT}],
            },
            CLIENT_ACCOUNT: {
                "users": [{"user": ADMIN, "password": self.admin_password}],
                "imports": [{"stream": {"account": AUTH_ACCOUNT, "subject": CALLOUT_HEARTBEAT}}],
            },
        }
        callout = {
            "issuer": self.issuer,
            "auth_users": [CALLOUT_USER, ADMIN],
            "account": AUTH_ACCOUNT,
        }
        return (
            f"accounts {json.dumps(accounts, indent=2)}\n"
            f"authorization {json.dumps({'auth_callout': callout}, indent=2)}\n"
        )


def server_config(
    users: list[NatsUser] | None,
    prefix: str,
    num_shards: int,
    *,
    tls: ServerTls | None = None,
    cluster: Cluster | None = None,
    max_payload: int | None = None,
    models: Sequence[ModelSubjects] = (),
    callout: AuthCallout | None = None,
) -> str:
    """A nats-server configuration file (listen address and port stay on its command line).
    With `tls`, the server refuses clients that do not speak TLS; `models`: those served on
    prefixes of their own beside the first (`permissions`); `callout` instead of `users`:
    clients authenticate through the auth callout."""
    if callout is not None and users is not None:
        raise ValueError("static users and the auth callout exclude each other")
    parts = []
    if max_payload is not None:
        parts.append(f"max_payload: {max_payload}\n")
    if tls is not None:
        parts.append(tls.block())
    if cluster is not None:
        parts.append(cluster.block())
    if users is not None:
        parts.append(authorization_block(users, prefix, num_shards, models))
    if callout is not None:
        parts.append(callout.block())
    return "".join(parts)


def write_private(path: Path, text: str) -> None:
    """Write a file only its owner can read (mode 0600 from the start)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _worker_user(spec: str, password_dir: Path) -> NatsUser:
    """`USER[=ID,...][@PREFIX]`."""
    spec, _, prefix = spec.partition("@")
    name, _, ids = spec.partition("=")
    worker_ids = tuple(ids.split(",")) if ids else (name,)
    return NatsUser(name, _password(password_dir, name), WORKER, worker_ids, prefix)


def model_subjects(spec: str) -> ModelSubjects:
    """`PREFIX[:SHARDS]`."""
    prefix, _, shards = spec.partition(":")
    return ModelSubjects(prefix, int(shards) if shards else 1)


def _password(password_dir: Path, user: str) -> str:
    return (password_dir / user).read_text().strip()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m shared.nats_auth",
        description="Write a nats-server configuration with skiff's users and permissions.",
    )
    p.add_argument("--subject-prefix", default=DEFAULT_SUBJECT_PREFIX)
    p.add_argument("--scheduler-shards", type=int, default=1)
    p.add_argument(
        "--password-dir",
        type=Path,
        help="one file per user, named by the user (default: no users, anyone may connect)",
    )
    p.add_argument(
        "--worker",
        action="append",
        default=[],
        metavar="USER[=ID,...][@PREFIX]",
        help="a worker user, the worker ids it hosts (default: its own name) and its model's "
        "subject prefix (default: --subject-prefix); repeatable",
    )
    p.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="PREFIX[:SHARDS]",
        help="another model served on its own subject prefix (and shard count); repeatable",
    )
    p.add_argument(
        "--auth-callout-issuer",
        default="",
        metavar="ACCOUNT_NKEY",
        help="authenticate clients through `skiff auth-callout`, whose signing key has this "
        f"public nkey; --password-dir then holds only {ADMIN!r} and {CALLOUT_USER!r}",
    )
    p.add_argument("--tls-cert", default="")
    p.add_argument("--tls-key", default="")
    p.add_argument("--tls-ca", default="", help="verify client certificates with this CA")
    p.add_argument("--cluster-name", default="", help="a cluster: its name (default: no routes)")
    p.add_argument(
        "--cluster-route",
        action="append",
        default=[],
        metavar="URL",
        help="every server's route URL, nats://HOST:6222; repeatable",
    )
    p.add_argument(
        "--cluster-tls-ca",
        default="",
        help="routes over TLS: the servers present --tls-cert and verify each other with this CA",
    )
    p.add_argument(
        "--route-password-file",
        type=Path,
        help=f"routes authenticate as the user {ROUTE_USER!r} with this password",
    )
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if (args.worker or args.auth_callout_issuer) and args.password_dir is None:
        p.error("--worker and --auth-callout-issuer need --password-dir")
    if args.worker and args.auth_callout_issuer:
        p.error("with --auth-callout-issuer the callout admits the workers: no --worker")
    routing = args.cluster_name or args.cluster_route or args.cluster_tls_ca
    if (routing or args.route_password_file) and not (args.cluster_name and args.cluster_route):
        p.error("a cluster needs --cluster-name and --cluster-route")
    if args.cluster_tls_ca and not args.tls_cert:
        p.error("--cluster-tls-ca needs --tls-cert and --tls-key")
    try:
        users, callout = None, None
        if args.auth_callout_issuer:
            callout = AuthCallout(
                args.auth_callout_issuer,
                _password(args.password_dir, CALLOUT_USER),
                _password(args.password_dir, ADMIN),
            )
        elif args.password_dir is not None:
            users = [
                NatsUser(r, _password(args.password_dir, r), r) for r in (ADMIN, GATEWAY, SCHEDULER)
            ]
            users += [_worker_user(spec, args.password_dir) for spec in args.worker]
        tls = ServerTls(args.tls_cert, args.tls_key, args.tls_ca) if args.tls_cert else None
        cluster = None
        if args.cluster_name:
            route_tls = None
            if args.cluster_tls_ca:
                route_tls = ServerTls(args.tls_cert, args.tls_key, args.cluster_tls_ca)
            password = ""
            if args.route_password_file is not None:
                try:
                    password = args.route_password_file.read_text().strip()
                except OSError as e:
                    raise ValueError(
                        f"cannot read the route password (the chart: key `route` of the NATS "
                        f"auth Secret): {e}"
                    ) from None
            cluster = Cluster(
                args.cluster_name, tuple(args.cluster_route), tls=route_tls, password=password
            )
        models = [model_subjects(spec) for spec in args.model]
        text = server_config(
            users,
            args.subject_prefix,
            args.scheduler_shards,
            tls=tls,
            cluster=cluster,
            models=models,
            callout=callout,
        )
    except (OSError, ValueError) as exc:
        p.error(str(exc))
    write_private(args.out, text)


if __name__ == "__main__":
    main()
