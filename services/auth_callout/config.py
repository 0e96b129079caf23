"""The auth callout's configuration (`skiff auth-callout` flags and SKIFF_* variables)."""

from __future__ import annotations

from dataclasses import dataclass

from services.auth_callout.identity import RoleMap
from shared.cli_args import setting
from shared.config import (
    DEFAULT_LOG_LEVEL,
    DEFAULT_SUBJECT_PREFIX,
    NatsClientConfig,
    check_positive,
)
from shared.nats_auth import CALLOUT_USER, CLIENT_ACCOUNT, ModelSubjects, model_subjects


def _items(text: str) -> tuple[str, ...]:
    return tuple(x for x in text.replace(",", " ").split() if x)


@dataclass(frozen=True)
class AuthCalloutConfig(NatsClientConfig):
    """The callout: its signing key, the token audience, the roles' service accounts and the
    subjects of the deployment it admits clients to."""

    nats_user: str = setting(CALLOUT_USER, "the callout's own NATS user (auth_users of the server)")
    signing_key_file: str = setting(
        "",
        "file holding the account nkey seed (SA...) that signs the user JWTs; nats-server's "
        "auth_callout issuer is its public key",
    )
    audience: str = setting("nats", "audience the clients' service-account tokens must carry")
    gateway_service_account: str = setting(
        "", "the gateways' service accounts, namespace/name, comma-separated"
    )
    scheduler_service_account: str = setting(
        "", "the schedulers' service accounts, namespace/name, comma-separated"
    )
    worker_service_account: str = setting(
        "",
        "the workers' service accounts, namespace/name[@PREFIX] (PREFIX: the subject prefix "
        "of the worker's model, default --subject-prefix), comma-separated",
    )
    subject_prefix: str = setting(DEFAULT_SUBJECT_PREFIX, "prefix of every NATS subject")
    scheduler_shards: int = setting(1, "scheduler shards of the first model")
    models: str = setting("", "the other models served, PREFIX[:SHARDS], comma-separated")
    account: str = setting(CLIENT_ACCOUNT, "the NATS account the admitted clients land in")
    kubeconfig: str = setting(
        "", "kubeconfig of the API server (default: the pod's service account)"
    )
    heartbeat_s: float = setting(
        5.0, "seconds between heartbeats; services report the callout lost after 3 missed"
    )
    log_level: str = setting(DEFAULT_LOG_LEVEL, "DEBUG, INFO, WARNING or ERROR")

    def __post_init__(self) -> None:
        check_positive(self, "scheduler_shards")
        check_positive(self, "heartbeat_s")
        if not self.signing_key_file:
            raise ValueError("--signing-key-file is required (the account nkey seed, SA...)")
        if not self.audience:
            raise ValueError("--audience must not be empty")
        self.roles()  # raises ValueError on a malformed service account
        self.other_models()

    def roles(self) -> RoleMap:
        return RoleMap(
            _items(self.gateway_service_account),
            _items(self.scheduler_service_account),
            _items(self.worker_service_account),
        )

    def other_models(self) -> tuple[ModelSubjects, ...]:
        try:
            return tuple(model_subjects(spec) for spec in _items(self.models))
        except ValueError as exc:
            raise ValueError(f"--models: {exc}") from None
