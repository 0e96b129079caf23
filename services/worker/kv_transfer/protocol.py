"""The KV-transfer wire format (see the package docstring), its errors and interfaces."""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable, Iterator
from typing import Annotated, Protocol

import msgspec
import xxhash

VERSION = 1
MAGIC = b"SKVT"
MAX_INDICES = 65536  # blocks in one request
MAX_REQUEST_BYTES = 1 << 20  # an encoded request
MAX_MESSAGE_BYTES = 4096  # an error frame's message
REQUEST_HEADER = struct.Struct("!4sI")  # magic, length of the encoded request
FRAME = struct.Struct("!BIQ")  # kind, length of the body that follows, checksum of the body
OK, BLOCK, ERROR, INTEGRITY_ERROR = 0, 1, 2, 3  # frame kinds
SOCKET_BUFFER_BYTES = 4 << 20  # send and receive buffers of a transfer connection


class KVTransferError(Exception):
    """A fetch failed: source unreachable, connection reset or timed out, wrong instance,
    unknown tier or index."""


class KVIntegrityError(KVTransferError):
    """A block's bytes do not match their checksum."""


def checksum(data: bytes | bytearray | memoryview) -> int:
    """The xxh3-64 of `data`: the one integrity check of KV blocks."""
    return xxhash.xxh3_64_intdigest(data)


class BlockSource(Protocol):
    def read_blocks(self, tier: str, indices: list[int]) -> Iterator[memoryview | bytes]:
        """Payloads of the blocks, in order; raises LookupError for a tier/index it cannot
        serve, KVIntegrityError for a stored block that fails its check."""
        ...


class KVTransport(Protocol):
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
        and was verified (payload valid only during the call: the caller copies it into its KV
        tensors); returns bytes moved. Raises KVTransferError / KVIntegrityError."""
        ...


class FetchRequest(msgspec.Struct, array_like=True):
    version: int
    instance_id: str
    tier: str
    indices: Annotated[
        list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(max_length=MAX_INDICES)
    ]
    block_bytes: Annotated[int, msgspec.Meta(gt=0, lt=1 << 32)]  # one payload's size


def encode_request(request: FetchRequest) -> bytes:
    body = msgspec.msgpack.encode(request)
    return REQUEST_HEADER.pack(MAGIC, len(body)) + body


decode_request = msgspec.msgpack.Decoder(FetchRequest).decode


def tune(sock: socket.socket) -> None:
    """Options of a transfer connection: no Nagle delay, buffers for whole blocks."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)


def recv_exact(sock: socket.socket, view: memoryview) -> int:
    """Fill `view` from `sock`; returns the bytes read, fewer only at end of stream (0 when it
    ended before the first)."""
    got, n = 0, view.nbytes
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            break
        got += k
    return got


def recv_all(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` from `sock`; ConnectionError when the stream ends first."""
    got = recv_exact(sock, view)
    if got < view.nbytes:
        raise ConnectionError(f"connection closed after {got} of {view.nbytes} bytes")


def send_frame(sock: socket.socket, header: bytes, body: memoryview) -> None:
    """Send a frame's header and body in one gather write where the socket takes it."""
    sent = sock.sendmsg([header, body])
    if sent < len(header):
        sock.sendall(header[sent:])
        sock.sendall(body)
    elif sent < len(header) + body.nbytes:
        sock.sendall(body[sent - len(header) :])
