"""The one way onto NATS for every service: connection options (credentials, TLS), typed
publish / subscribe, request-reply, and version checks.

Messages are the structs of `shared.wire`. A message larger than the server's payload limit
(1 MiB by default) is published as numbered parts carrying `Skiff-Msg` / `Skiff-Part` headers
and joined again by `Reassembler` before decoding. Request-reply messages are never split: a
request or reply over the limit raises `nats.errors.MaxPayloadError`.

A received message that does not decode, or whose `version` is not `PROTOCOL_VERSION`, is
dropped with a warning (`subscribe`), answered with `on_malformed` (`serve`) or raised as
`msgspec.DecodeError` (`request`; `IncompatibleVersionError` for a wrong version).
"""

from __future__ import annotations

import logging
import os
import ssl
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import nats
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from shared.arith import cdiv
from shared.cli_args import env_var
from shared.config import NatsClientConfig
from shared.nats_auth import inbox_prefix
from shared.wire import PROTOCOL_VERSION, decoder, encode

log = logging.getLogger("skiff.bus")

M = TypeVar("M", bound=msgspec.Struct)
R = TypeVar("R", bound=msgspec.Struct)

USER_EXPIRED = "user authentication expired"  # nats-server's -ERR when a user JWT expires
HEADER_ROOM = 512  # bytes kept free for subject, headers and protocol framing
_MSG_ID, _PART = "Skiff-Msg", "Skiff-Part"


class IncompatibleVersionError(msgspec.DecodeError):
    """A well-formed message from a peer speaking another protocol version."""


@dataclass(frozen=True)
class ConnectOptions:
    """Credentials and TLS of one connection. With a user, request-reply inboxes are the
    user's own (`shared.nats_auth.inbox_prefix`); with a CA file, the server must present a
    certificate it signed; a client certificate is presented when given."""

    user: str = ""
    password: str = ""
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    token_file: str = ""  # the auth callout's token, read at every (re)connection

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("a NATS client certificate needs its key, and a key its certificate")
        if (self.tls_cert or self.tls_key) and not self.tls_ca:
            raise ValueError("a NATS client certificate needs the CA file (nats_tls_ca) too")
        if self.password and not self.user:
            raise ValueError("a NATS password needs a user (nats_user)")
        if self.token_file and self.password:
            raise ValueError("a NATS token file and a password exclude each other")

    @classmethod
    def from_config(cls, config: NatsClientConfig) -> ConnectOptions:
        """From a service's settings; the password from its file, else SKIFF_NATS_PASSWORD."""
        password = os.environ.get(env_var("nats_password"), "")
        if config.nats_password_file:
            try:
                password = Path(config.nats_password_file).read_text().strip()
            except OSError as e:
                raise ValueError(f"cannot read the NATS password file: {e}") from None
        if config.nats_token_file:
            read_token(config.nats_token_file)  # fails at the start, not at each reconnection
        return cls(
            config.nats_user,
            password,
            config.nats_tls_ca,
            config.nats_tls_cert,
            config.nats_tls_key,
            config.nats_token_file,
        )

    def nats_kwargs(self) -> dict[str, object]:
        """Keyword arguments of `nats.connect`."""
        kwargs: dict[str, object] = {}
        if self.user:
            kwargs["inbox_prefix"] = inbox_prefix(self.user)
        if self.token_file:
            kwargs["token"] = lambda: _current_token(self.token_file)
        elif self.user:
            kwargs.update(user=self.user, password=self.password)
        if self.tls_ca:
            context = ssl.create_default_context(cafile=self.tls_ca)
            if self.tls_cert:
                context.load_cert_chain(self.tls_cert, self.tls_key)
            kwargs["tls"] = context
        return kwargs


def read_token(path: str) -> str:
    """The service-account token in `path`; ValueError naming the file otherwise."""
    try:
        token = Path(path).read_text().strip()
    except OSError as e:
        raise ValueError(f"cannot read the NATS token file (nats_token_file): {e}") from None
    if not token:
        raise ValueError(f"the NATS token file {path} is empty (nats_token_file)")
    return token


def _current_token(path: str) -> str:
    try:
        return read_token(path)
    except ValueError as e:
        log.warning("%s", e)  # the server refuses the connection; the next try reads again
        return ""


class RenewingClient(Client):
    """nats-py's client, reconnecting (as the Go client does) when the server ends a connection
    because its user's credential expired, where nats-py gives up: the auth callout's user JWTs
    expire with the pod's token, and the reconnection presents the kubelet's fresh one."""

    async def _process_err(self, err_msg: str) -> None:
        if USER_EXPIRED in err_msg.lower():
            log.info("nats: the credential expired; reconnecting with the current token")
            await self._process_op_err(nats.errors.Error(f"nats: {err_msg.strip(chr(39))}"))
            return
        await super()._process_err(err_msg)


async def connect(
    url: str | list[str],
    name: str,
    *,
    options: ConnectOptions | None = None,
    on_reconnect: Callable[[], Awaitable[None]] | None = None,
    on_error: Callable[[Exception], Awaitable[None]] | None = None,
) -> Client:
    """Connect and keep reconnecting forever (also for the first connection): a NATS blip must
    never end a service. The hooks run after the event is logged; after a reconnection,
    messages in flight may have been lost. A refused credential is logged and retried too: a
    NATS server whose users are not loaded yet ends no service."""

    async def error_cb(exc: Exception) -> None:
        log.warning("nats error: %s", exc)
        if on_error is not None:
            await on_error(exc)

    async def disconnected_cb() -> None:
        log.warning("nats disconnected")

    async def reconnected_cb() -> None:
        log.info("nats reconnected")
        if on_reconnect is not None:
            await on_reconnect()

    options = options or ConnectOptions()
    settings: dict[str, Any] = {
        "name": name,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": 0.25,
        "connect_timeout": 2,
        "ping_interval": 5,
        "max_outstanding_pings": 3,
        "error_cb": error_cb,
        "disconnected_cb": disconnected_cb,
        "reconnected_cb": reconnected_cb,
        **options.nats_kwargs(),
    }
    nc = RenewingClient()
    await nc.connect(url, **settings)
    if options.token_file:  # admitted by the auth callout: /health tells when it is lost
        from shared import callout_watch  # it subscribes through this module

        await callout_watch.watch(nc)
    return nc


async def publish(nc: Client, subject: str, msg: msgspec.Struct) -> int:
    """Encode and publish, in parts when the payload exceeds the server's limit; returns the
    encoded size in bytes."""
    payload = encode(msg)
    limit = max(nc.max_payload - HEADER_ROOM, 1024)
    if len(payload) <= limit:
        await nc.publish(subject, payload)
        return len(payload)
    msg_id = uuid.uuid4().hex
    num_parts = cdiv(len(payload), limit)
    for i in range(num_parts):
        headers = {_MSG_ID: msg_id, _PART: f"{i}/{num_parts}"}
        await nc.publish(subject, payload[i * limit : (i + 1) * limit], headers=headers)
    return len(payload)


async def subscribe(
    nc: Client,
    subject: str,
    msg_type: type[M],
    handler: Callable[[M], Awaitable[None]],
    *,
    queue: str = "",
) -> Subscription:
    """Subscribe; `handler` sees whole, decoded messages of the current protocol version."""

    async def on_message(_subject: str, message: M) -> None:
        await handler(message)

    return await subscribe_with_subject(nc, subject, msg_type, on_message, queue=queue)


async def subscribe_with_subject(
    nc: Client,
    subject: str,
    msg_type: type[M],
    handler: Callable[[str, M], Awaitable[None]],
    *,
    queue: str = "",
) -> Subscription:
    """As `subscribe`, `handler` also seeing the subject each message came on (a wildcard
    subscription's tokens name its sender)."""
    reassembler = Reassembler()
    typed = decoder(msg_type)

    async def on_msg(msg: Msg) -> None:
        payload = reassembler.feed(msg)
        if payload is None:
            return
        try:
            message = _decode(typed, payload)
        except msgspec.DecodeError as e:
            log.warning("dropping a %s on %s: %s", msg_type.__name__, subject, e)
            return
        await handler(msg.subject, message)

    return await nc.subscribe(subject, queue=queue, cb=on_msg)


async def flush(nc: Client) -> None:
    """Return once the server has processed every command `nc` was given before, e.g. a
    subscription that another connection's publish must find. nats-py's `Client.flush` writes
    its PING at once, ahead of the commands still queued for its flusher task (a SUB just
    made), so its PONG can come back before the server saw them: those are written first."""
    await nc._flush_pending(force_flush=True)
    await nc.flush()


async def request(
    nc: Client, subject: str, msg: msgspec.Struct, reply_type: type[R], timeout: float
) -> R:
    """Send a request and decode its reply. NATS errors (`NoRespondersError`, `TimeoutError`)
    propagate; a malformed or wrong-version reply raises `msgspec.DecodeError`."""
    reply = await nc.request(subject, encode(msg), timeout=timeout)
    return _decode(decoder(reply_type), reply.data)


async def serve(
    nc: Client,
    subject: str,
    msg_type: type[M],
    handler: Callable[[M], Awaitable[msgspec.Struct]],
    *,
    on_malformed: Callable[[str], msgspec.Struct] | None = None,
) -> Subscription:
    """Answer requests with `handler`'s reply. A malformed or wrong-version request is answered
    with `on_malformed(error text)` if given, else dropped with a warning."""
    typed = decoder(msg_type)

    async def on_msg(msg: Msg) -> None:
        try:
            message = _decode(typed, msg.data)
        except msgspec.DecodeError as e:
            if on_malformed is None:
                log.warning("dropping a %s on %s: %s", msg_type.__name__, subject, e)
                return
            reply = on_malformed(str(e))
        else:
            reply = await handler(message)
        await msg.respond(encode(reply))

    return await nc.subscribe(subject, cb=on_msg)


class Reassembler:
    """Feeds messages in arrival order; returns whole payloads (NATS keeps per-publisher order
    on one subject, so parts of one message arrive in sequence)."""

    def __init__(self, max_pending: int = 64) -> None:
        self._parts: dict[str, list[bytes]] = {}
        self.max_pending = max_pending

    def feed(self, msg: Msg) -> bytes | None:
        headers = msg.headers or {}
        part = headers.get(_PART)
        if part is None:
            return msg.data
        try:
            msg_id = headers[_MSG_ID]
            index, total = (int(x) for x in part.split("/"))
        except (KeyError, ValueError):
            log.warning("dropping a part with malformed headers: %s", headers)
            return None
        if index == 0:
            if len(self._parts) >= self.max_pending:  # drop the oldest incomplete message
                self._parts.pop(next(iter(self._parts)))
            self._parts[msg_id] = []
        parts = self._parts.get(msg_id)
        if parts is None or len(parts) != index or index >= total:
            self._parts.pop(msg_id, None)
            log.warning("dropping out-of-order part %s of %s", part, msg_id)
            return None
        parts.append(msg.data)
        if index + 1 < total:
            return None
        return b"".join(self._parts.pop(msg_id))


def _decode(typed: msgspec.msgpack.Decoder[M], payload: bytes) -> M:
    message = typed.decode(payload)
    version = getattr(message, "version", None)
    if version != PROTOCOL_VERSION:
        raise IncompatibleVersionError(f"protocol version {version}, expected {PROTOCOL_VERSION}")
    return message
