"""The client side of KV transfer over TCP, with a small pool of connections per address."""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Callable
from typing import NoReturn

from services.worker.kv_transfer.protocol import (
    BLOCK,
    ERROR,
    FRAME,
    INTEGRITY_ERROR,
    MAX_INDICES,
    MAX_MESSAGE_BYTES,
    OK,
    VERSION,
    FetchRequest,
    KVIntegrityError,
    KVTransferError,
    checksum,
    encode_request,
    recv_all,
    tune,
)

POOL_SIZE = 4  # idle connections kept per address
POOL_IDLE_S = 30.0  # an idle connection older than this is not reused (the server ends it at 60)


class TcpTransport:
    """A KVTransport over TCP; thread-safe (one connection per fetch in flight). `timeout_s`
    bounds connecting and each read or write of a fetch."""

    def __init__(self, timeout_s: float = 10.0) -> None:
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._idle: dict[str, list[tuple[float, socket.socket]]] = {}

    def fetch(
        self,
        address: str,
        instance_id: str,
        tier: str,
        indices: list[int],
        block_bytes: int,
        out: Callable[[int, memoryview], None],
    ) -> int:
        """Fetch blocks `indices` of `tier` from the worker instance `instance_id` serving at
        `address` ("host:port"); calls out(i, payload) for the i-th block as soon as it arrived
        and was verified (payload valid only during the call); returns bytes moved."""
        if not indices:
            return 0
        what = f"KV fetch of {len(indices)} {tier} blocks from {instance_id} at {address}"
        if len(indices) > MAX_INDICES:
            raise KVTransferError(f"{what}: more than {MAX_INDICES} blocks")
        if not 0 < block_bytes < 1 << 32:
            raise KVTransferError(f"{what}: blocks of {block_bytes} bytes")
        request = encode_request(FetchRequest(VERSION, instance_id, tier, indices, block_bytes))
        sock = self._connect(address, what)
        try:
            moved = self._exchange(sock, request, what, len(indices), block_bytes, out)
        except OSError as exc:
            sock.close()
            raise KVTransferError(f"{what}: {type(exc).__name__}: {exc}") from exc
        except BaseException:
            sock.close()  # a failed reply, or out() failed: the rest of the reply is unread
            raise
        self._release(address, sock)
        return moved

    def close(self) -> None:
        """Close the idle connections."""
        with self._lock:
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for _, sock in conns:
                sock.close()

    def _exchange(
        self,
        sock: socket.socket,
        request: bytes,
        what: str,
        n: int,
        block_bytes: int,
        out: Callable[[int, memoryview], None],
    ) -> int:
        """Send `request` and hand its `n` blocks to `out`; returns the payload bytes."""
        sock.sendall(request)
        header = bytearray(FRAME.size)
        head = memoryview(header)
        recv_all(sock, head)
        kind, length, _ = FRAME.unpack(header)
        if kind != OK:
            _raise_refusal(sock, kind, length, what)
        payload = memoryview(bytearray(block_bytes))
        for i in range(n):
            recv_all(sock, head)
            kind, length, digest = FRAME.unpack(header)
            if kind != BLOCK:
                _raise_refusal(sock, kind, length, what)
            if length != block_bytes:
                raise KVTransferError(f"{what}: block {i} of {length} bytes, not {block_bytes}")
            recv_all(sock, payload)
            if checksum(payload) != digest:
                raise KVIntegrityError(f"{what}: block {i}: checksum mismatch")
            out(i, payload)
        return n * block_bytes

    def _connect(self, address: str, what: str) -> socket.socket:
        """An idle pooled connection to `address`, else a new one."""
        stale: list[socket.socket] = []
        sock: socket.socket | None = None
        now = time.monotonic()
        with self._lock:
            idle = self._idle.get(address, [])
            while idle and sock is None:
                since, conn = idle.pop()
                if now - since < POOL_IDLE_S and _still_open(conn):
                    sock = conn
                else:
                    stale.append(conn)
        for conn in stale:
            conn.close()
        if sock is not None:
            return sock
        host, _, port = address.rpartition(":")
        try:
            sock = socket.create_connection((host.strip("[]"), int(port)), self.timeout_s)
        except (OSError, ValueError) as exc:
            raise KVTransferError(f"{what}: cannot connect: {exc}") from exc
        tune(sock)
        return sock

    def _release(self, address: str, sock: socket.socket) -> None:
        with self._lock:
            idle = self._idle.setdefault(address, [])
            if len(idle) < POOL_SIZE:
                idle.append((time.monotonic(), sock))
                return
        sock.close()


def _still_open(sock: socket.socket) -> bool:
    """Whether an idle connection has nothing to read: not closed by its peer, no stray
    bytes."""
    poll = select.poll()
    poll.register(sock, select.POLLIN)
    return not poll.poll(0)


def _raise_refusal(sock: socket.socket, kind: int, length: int, what: str) -> NoReturn:
    """Read an error frame's message and raise it."""
    if kind not in (ERROR, INTEGRITY_ERROR) or length > MAX_MESSAGE_BYTES:
        raise KVTransferError(f"{what}: unexpected reply frame (kind {kind}, {length} bytes)")
    body = bytearray(length)
    recv_all(sock, memoryview(body))
    message = body.decode(errors="replace")
    if kind == INTEGRITY_ERROR:
        raise KVIntegrityError(f"{what}: the source's block failed its check: {message}")
    raise KVTransferError(f"{what}: {message}")
