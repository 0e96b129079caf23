"""A real nats-server that authenticates clients through the auth callout, and the callout's
side of the exchange run in the test's own event loop (its TokenReview chosen by the test)."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import nats
import nkeys
from nats.aio.client import Client

from services.auth_callout import nats_jwt
from services.auth_callout.authorizer import Authorizer
from services.auth_callout.identity import RoleMap
from services.auth_callout.main import listen
from services.auth_callout.token_review import Reviewer
from services.launcher import free_port, nats_server_binary
from shared.nats_auth import ADMIN, CALLOUT_USER, AuthCallout, server_config, write_private

PREFIX = "skiff"
ROLES = RoleMap(gateways=("ns/gateway",), schedulers=("ns/scheduler",), workers=("ns/worker",))


@dataclass
class CalloutBroker:
    url: str
    signer: nkeys.KeyPair
    seed_file: Path
    callout_password: str
    admin_password: str

    async def admin(self) -> Client:
        return await nats.connect(self.url, user=ADMIN, password=self.admin_password)

    async def callout_connection(self) -> Client:
        return await nats.connect(self.url, user=CALLOUT_USER, password=self.callout_password)

    @contextlib.asynccontextmanager
    async def callout(self, review: Reviewer, roles: RoleMap = ROLES) -> AsyncIterator[Client]:
        """The callout answering with `review` until the block ends."""
        nc = await self.callout_connection()
        await listen(nc, Authorizer(roles, review, self.signer, PREFIX, 1))
        await nc.flush()
        try:
            yield nc
        finally:
            await nc.close()


def _wait_port(port: int, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        assert proc.poll() is None, "nats-server exited"
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nats-server did not open {port}")


@contextlib.contextmanager
def callout_broker(tmp_path: Path) -> Iterator[CalloutBroker]:
    seed = nats_jwt.new_account_seed()
    signer = nats_jwt.key_pair(seed)
    seed_file = tmp_path / "signing.nk"
    write_private(seed_file, seed)
    callout = AuthCallout(nats_jwt.public_key(signer), "callout-pw", "admin-pw")
    conf = tmp_path / "nats.conf"
    write_private(conf, server_config(None, PREFIX, 1, callout=callout))
    port = free_port()
    argv = [nats_server_binary(), "-a", "127.0.0.1", "-p", str(port), "-c", str(conf)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_port(port, proc)
        yield CalloutBroker(f"nats://127.0.0.1:{port}", signer, seed_file, "callout-pw", "admin-pw")
    finally:
        proc.terminate()
        proc.wait(10)
