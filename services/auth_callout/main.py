"""`skiff auth-callout`: answers nats-server's `$SYS.REQ.USER.AUTH` requests (queue group: any
number of replicas) and publishes heartbeats that tell the services it is alive. Start-up fails
with one line naming what to fix when the signing key, the API server or its TokenReview
permission is missing. nats-server keeps the connections it has admitted while the callout is
away; only new ones wait for it, and the services' /health says it is lost."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import nkeys
import uvloop
from kubernetes.aio.client import ApiClient
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from services.auth_callout import nats_jwt
from services.auth_callout.authorizer import Authorizer
from services.auth_callout.config import AuthCalloutConfig
from services.auth_callout.token_review import ReviewUnavailable, check_reviews, token_reviewer
from shared import bus
from shared.cli_args import ConfigParser, wait_for_signal
from shared.config import TelemetryConfig
from shared.logs import setup_logging
from shared.nats_auth import CALLOUT_HEARTBEAT
from shared.wire import CalloutHeartbeat

AUTH_SUBJECT = "$SYS.REQ.USER.AUTH"
QUEUE = "skiff-auth-callout"

log = logging.getLogger("skiff.auth_callout")


class StartupError(Exception):
    """A setting to fix before the callout can run."""


def build_parser() -> ConfigParser:
    p = ConfigParser(prog="skiff auth-callout", description=__doc__)
    p.add_config(AuthCalloutConfig)
    p.add_config(TelemetryConfig)
    return p


def load_signer(path: str) -> nkeys.KeyPair:
    """The account key pair that signs the user JWTs."""
    try:
        signer = nats_jwt.key_pair(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise StartupError(f"--signing-key-file {path}: {exc}") from None
    if not nats_jwt.public_key(signer).startswith("A"):
        raise StartupError(f"--signing-key-file {path}: not an account seed (SA...)")
    return signer


async def api_client(kubeconfig: str) -> ApiClient:
    from kubernetes.aio.config import ConfigException, load_incluster_config, new_client_from_config

    try:
        if kubeconfig:
            api: ApiClient = await new_client_from_config(kubeconfig)  # type: ignore[no-untyped-call]
            return api
        load_incluster_config()  # type: ignore[no-untyped-call]
        return ApiClient()
    except (ConfigException, OSError) as exc:
        raise StartupError(f"no API server: {exc}; set --kubeconfig or run in a pod") from None


async def listen(nc: Client, authorizer: Authorizer) -> Subscription:
    """Answer the authorization requests that reach `nc` (the callout's user)."""
    pending: set[asyncio.Task[None]] = set()  # reviews run side by side

    async def respond(msg: Msg) -> None:
        response = await authorizer.answer(msg.data.decode(errors="replace"))
        if response is not None and msg.reply:
            await nc.publish(msg.reply, response.encode())

    async def on_request(msg: Msg) -> None:
        task = asyncio.create_task(respond(msg))
        pending.add(task)
        task.add_done_callback(pending.discard)

    return await nc.subscribe(AUTH_SUBJECT, queue=QUEUE, cb=on_request)


async def heartbeats(nc: Client, interval_s: float) -> None:
    """Tell every client the callout is alive (`shared.callout_watch`), until cancelled."""
    beat = CalloutHeartbeat(interval_s=interval_s)
    while True:
        await bus.publish(nc, CALLOUT_HEARTBEAT, beat)
        await asyncio.sleep(interval_s)


async def serve(config: AuthCalloutConfig) -> None:
    signer = load_signer(config.signing_key_file)
    api = await api_client(config.kubeconfig)
    try:
        review = token_reviewer(api, config.audience)
        try:
            await check_reviews(review)
        except ReviewUnavailable as exc:
            raise StartupError(
                f"{exc}: check the API server and the `create tokenreviews` permission"
            ) from None
        authorizer = Authorizer(
            config.roles(), review, signer, config.subject_prefix, config.scheduler_shards,
            config.other_models(), config.account,
        )  # fmt: skip
        options = bus.ConnectOptions.from_config(config)
        nc = await bus.connect(config.nats_url, "auth-callout", options=options)
        await listen(nc, authorizer)
        beating = asyncio.create_task(heartbeats(nc, config.heartbeat_s))
        issuer = nats_jwt.public_key(signer)
        log.info("answering %s as %s, issuer %s", AUTH_SUBJECT, config.nats_user, issuer)
        try:
            await wait_for_signal()
        finally:
            beating.cancel()
            await nc.drain()
    finally:
        await api.close()  # type: ignore[no-untyped-call]


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    _, configs = parser.parse_configs(argv)
    config: AuthCalloutConfig = configs[AuthCalloutConfig]
    setup_logging(config.log_level, "auth-callout", configs[TelemetryConfig].log_format)
    try:
        uvloop.run(serve(config))
    except (StartupError, ValueError) as exc:
        raise SystemExit(f"skiff auth-callout: {exc}") from None
