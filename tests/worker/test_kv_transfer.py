"""KV transfer over real sockets on 127.0.0.1: fetched blocks equal the source's, concurrent
fetches and reused connections work, and every failure (wrong instance, unknown tier or index,
corruption on the wire or at the source, a server gone mid-stream or not answering) is a
KVTransferError, promptly, while the server keeps serving; garbage does not kill it."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
import xxhash

from services.worker.kv_transfer import (
    BlockSource,
    KVIntegrityError,
    KVTransferError,
    TcpTransport,
    TransferServer,
    checksum,
    loopback_bandwidth,
)
from services.worker.kv_transfer.protocol import (
    ERROR,
    FRAME,
    MAGIC,
    MAX_REQUEST_BYTES,
    REQUEST_HEADER,
)

pytestmark = pytest.mark.unit

LAYERS, BS, HEADS, DIM = 3, 4, 2, 8
NUM_BLOCKS = 12
INSTANCE = "worker-a-1"
Serve = Callable[..., TransferServer]  # starts a server (closed after the test)


class TensorSource:
    """Tier "host": blocks of a [NUM_BLOCKS, LAYERS, 2, BS, HEADS, DIM] float32 tensor; tier
    "disk": rows of a [NUM_BLOCKS, block_bytes] uint8 array."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.host = torch.randn(NUM_BLOCKS, LAYERS, 2, BS, HEADS, DIM, generator=g)
        self.disk = np.random.default_rng(1).integers(
            0, 256, (NUM_BLOCKS, self.block_bytes), dtype=np.uint8
        )

    @property
    def block_bytes(self) -> int:
        return self.host[0].numel() * self.host.element_size()

    def expected(self, tier: str, i: int) -> bytes:
        return self.host[i].numpy().tobytes() if tier == "host" else self.disk[i].tobytes()

    def read_blocks(self, tier: str, indices: list[int]) -> Iterator[memoryview | bytes]:
        if tier not in ("host", "disk"):
            raise LookupError(f"KV tier {tier!r}: none here")
        bad = [i for i in indices if not 0 <= i < NUM_BLOCKS]
        if bad:
            raise IndexError(f"{tier} has {NUM_BLOCKS} blocks: no block {bad[0]}")
        if tier == "host":
            return (self.host[i].numpy().data for i in indices)  # float32, 5-d views
        return (self.disk[i].data for i in indices)


class Collect:
    """An out() callback keeping a copy of each payload."""

    def __init__(self) -> None:
        self.blocks: dict[int, bytes] = {}

    def __call__(self, i: int, payload: memoryview) -> None:
        self.blocks[i] = bytes(payload)


def served_eventually(server: TransferServer, num_bytes: int) -> None:
    """The server counts a block once sent: soon after the client got it."""
    deadline = time.monotonic() + 2.0
    while server.bytes_served != num_bytes and time.monotonic() < deadline:
        time.sleep(0.005)
    assert server.bytes_served == num_bytes


@pytest.fixture
def source() -> TensorSource:
    return TensorSource()


@pytest.fixture
def serve() -> Iterator[Serve]:
    servers: list[TransferServer] = []

    def start(
        src: BlockSource, cls: type[TransferServer] = TransferServer, **kw: Any
    ) -> TransferServer:
        server = cls(src, kw.pop("instance_id", INSTANCE), **kw)
        server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()


@pytest.fixture
def transport() -> Iterator[TcpTransport]:
    t = TcpTransport(timeout_s=2.0)
    yield t
    t.close()


def test_checksum_is_xxh3_64() -> None:
    data = bytes(range(256)) * 10
    assert checksum(data) == checksum(memoryview(data)) == xxhash.xxh3_64_intdigest(data)
    assert checksum(data) != checksum(data[:-1] + b"\x00")


def test_round_trip_equals_source(
    serve: Serve, source: TensorSource, transport: TcpTransport
) -> None:
    server = serve(source)
    for tier, indices in [("host", [3, 0, 11, 3]), ("disk", list(range(NUM_BLOCKS)))]:
        got = Collect()
        moved = transport.fetch(server.address, INSTANCE, tier, indices, source.block_bytes, got)
        assert moved == len(indices) * source.block_bytes
        assert got.blocks == {i: source.expected(tier, b) for i, b in enumerate(indices)}
    served_eventually(server, (4 + NUM_BLOCKS) * source.block_bytes)
    assert transport.fetch(server.address, INSTANCE, "host", [], source.block_bytes, Collect()) == 0


def test_concurrent_fetches(serve: Serve, source: TensorSource, transport: TcpTransport) -> None:
    server = serve(source)
    results: dict[int, Collect] = {}
    errors: list[BaseException] = []

    def fetch(k: int) -> None:
        try:
            for _ in range(5):
                got = Collect()
                indices = [(k + j) % NUM_BLOCKS for j in range(6)]
                transport.fetch(server.address, INSTANCE, "disk", indices, source.block_bytes, got)
                assert got.blocks == {i: source.expected("disk", b) for i, b in enumerate(indices)}
            results[k] = got
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=fetch, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert not errors
    assert len(results) == 8
    served_eventually(server, 8 * 5 * 6 * source.block_bytes)


def test_wrong_instance_refused(
    serve: Serve, source: TensorSource, transport: TcpTransport
) -> None:
    server = serve(source)
    with pytest.raises(KVTransferError, match="wrong instance 'worker-a-0'"):
        transport.fetch(server.address, "worker-a-0", "host", [0], source.block_bytes, Collect())
    assert server.bytes_served == 0


def test_restarted_worker_at_same_address_refuses_old_instance(
    serve: Serve, source: TensorSource, transport: TcpTransport
) -> None:
    """A pooled connection to the old process is not reused; the new one refuses the old id."""
    old = serve(source)
    transport.fetch(old.address, INSTANCE, "host", [1], source.block_bytes, Collect())
    old.close()
    port = int(old.address.rpartition(":")[2])
    new = serve(source, instance_id="worker-a-2", port=port)
    assert new.address == old.address
    with pytest.raises(KVTransferError, match="wrong instance"):
        transport.fetch(old.address, INSTANCE, "host", [1], source.block_bytes, Collect())
    got = Collect()
    transport.fetch(new.address, "worker-a-2", "host", [1], source.block_bytes, got)
    assert got.blocks == {0: source.expected("host", 1)}


@pytest.mark.parametrize(
    ("tier", "indices", "reason"),
    [
        ("device", [0], "KV tier 'device': none here"),
        ("host", [0, NUM_BLOCKS], f"host has {NUM_BLOCKS} blocks: no block {NUM_BLOCKS}"),
        ("host", [-1], "bad request: Expected `int` >= 0"),
    ],
)
def test_unknown_tier_or_index(
    serve: Serve,
    source: TensorSource,
    transport: TcpTransport,
    tier: str,
    indices: list[int],
    reason: str,
) -> None:
    server = serve(source)
    got = Collect()
    with pytest.raises(KVTransferError, match=reason) as info:
        transport.fetch(server.address, INSTANCE, tier, indices, source.block_bytes, got)
    assert not isinstance(info.value, KVIntegrityError)
    assert not got.blocks
    transport.fetch(server.address, INSTANCE, "host", [0], source.block_bytes, got)  # still serves


def test_wrong_block_size_refused(
    serve: Serve, source: TensorSource, transport: TcpTransport
) -> None:
    server = serve(source)
    with pytest.raises(KVTransferError, match=f"blocks here are {source.block_bytes} bytes"):
        transport.fetch(server.address, INSTANCE, "host", [0], source.block_bytes - 4, Collect())


class CorruptingServer(TransferServer):
    """Flips one bit of block 1's payload after its checksum was taken."""

    def _send_block(self, conn: socket.socket, data: memoryview, digest: int) -> None:
        if self.bytes_served == 2 * data.nbytes:  # the second block (counted before it is sent)
            bad = bytearray(data)
            bad[len(bad) // 2] ^= 0x10
            data = memoryview(bad)
        super()._send_block(conn, data, digest)


def test_corrupted_payload(serve: Serve, source: TensorSource, transport: TcpTransport) -> None:
    server = serve(source, cls=CorruptingServer)
    got = Collect()
    with pytest.raises(KVIntegrityError, match="block 1: checksum mismatch"):
        transport.fetch(server.address, INSTANCE, "host", [0, 1, 2], source.block_bytes, got)
    assert got.blocks == {0: source.expected("host", 0)}  # the bad block never reached out()
    got = Collect()
    transport.fetch(server.address, INSTANCE, "host", [2, 1], source.block_bytes, got)
    assert got.blocks == {0: source.expected("host", 2), 1: source.expected("host", 1)}


class FailingSource(TensorSource):
    """Disk slot 5 fails its check when read; slot 6 raises an I/O error."""

    def read_blocks(self, tier: str, indices: list[int]) -> Iterator[memoryview | bytes]:
        blocks = super().read_blocks(tier, indices)
        if tier == "disk" and indices[0] == 5:
            raise KVIntegrityError("disk slot 5: checksum mismatch")  # at once

        def lazily() -> Iterator[memoryview | bytes]:
            for i, block in zip(indices, blocks, strict=True):
                if tier == "disk" and i == 5:
                    raise KVIntegrityError("disk slot 5: checksum mismatch")
                if tier == "disk" and i == 6:
                    raise OSError(5, "Input/output error")
                yield block

        return lazily()


@pytest.mark.parametrize(
    ("indices", "error", "reason", "before"),
    [
        ([5, 0], KVIntegrityError, "failed its check: disk slot 5: checksum mismatch", 0),
        ([0, 5], KVIntegrityError, "failed its check: disk slot 5: checksum mismatch", 1),
        ([0, 1, 6], KVTransferError, r"OSError: \[Errno 5\] Input/output error", 2),
    ],
)
def test_source_failure_is_an_error_and_server_keeps_serving(
    serve: Serve,
    transport: TcpTransport,
    indices: list[int],
    error: type[KVTransferError],
    reason: str,
    before: int,
) -> None:
    source = FailingSource()
    server = serve(source)
    got = Collect()
    with pytest.raises(error, match=reason):
        transport.fetch(server.address, INSTANCE, "disk", indices, source.block_bytes, got)
    assert len(got.blocks) == before
    got = Collect()
    transport.fetch(server.address, INSTANCE, "disk", [4, 7], source.block_bytes, got)
    assert got.blocks == {0: source.expected("disk", 4), 1: source.expected("disk", 7)}


class StallingSource(TensorSource):
    """Yields one block, then waits for `resume`."""

    def __init__(self) -> None:
        super().__init__()
        self.resume = threading.Event()

    def read_blocks(self, tier: str, indices: list[int]) -> Iterator[memoryview | bytes]:
        blocks = super().read_blocks(tier, indices)
        yield next(blocks)
        self.resume.wait(timeout=5)
        yield from blocks


def test_server_closed_mid_stream(serve: Serve, transport: TcpTransport) -> None:
    source = StallingSource()
    server = serve(source)
    got = Collect()

    def out(i: int, payload: memoryview) -> None:
        got(i, payload)
        server.close()

    start = time.monotonic()
    with pytest.raises(KVTransferError, match=r"connection closed|Connection reset"):
        transport.fetch(server.address, INSTANCE, "host", [0, 1, 2], source.block_bytes, out)
    assert time.monotonic() - start < 1.0
    assert list(got.blocks) == [0]
    source.resume.set()
    with pytest.raises(KVTransferError, match="cannot connect"):
        transport.fetch(server.address, INSTANCE, "host", [0], source.block_bytes, Collect())


def test_unreachable_address() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"  # bound, not listening: refused
    transport = TcpTransport(timeout_s=0.5)
    start = time.monotonic()
    with pytest.raises(KVTransferError, match="cannot connect"):
        transport.fetch(address, INSTANCE, "host", [0], 64, Collect())
    with pytest.raises(KVTransferError, match="cannot connect"):
        transport.fetch("no-port", INSTANCE, "host", [0], 64, Collect())
    assert time.monotonic() - start < 1.0


def test_silent_server_times_out() -> None:
    """A peer that accepts and never answers: the fetch fails after the timeout."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        transport = TcpTransport(timeout_s=0.3)
        start = time.monotonic()
        with pytest.raises(KVTransferError, match="TimeoutError"):
            transport.fetch(address, INSTANCE, "host", [0], 64, Collect())
        assert 0.3 <= time.monotonic() - start < 1.5


def _raw(address: str, data: bytes) -> bytes:
    """Send `data` on a fresh connection; everything the server answers before it closes the
    connection (or resets it: it closed with `data` unread)."""
    host, _, port = address.rpartition(":")
    reply = b""
    with socket.create_connection((host, int(port)), timeout=2) as s:
        s.sendall(data)
        try:
            s.shutdown(socket.SHUT_WR)
            while chunk := s.recv(65536):
                reply += chunk
        except TimeoutError:  # the server kept the connection open
            raise
        except OSError:  # reset, or not connected (ENOTCONN): the server closed first
            pass
    return reply


def test_garbage_does_not_kill_the_server(
    serve: Serve, source: TensorSource, transport: TcpTransport
) -> None:
    server = serve(source)
    assert _raw(server.address, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n") == b""  # closed, no reply
    assert _raw(server.address, MAGIC[:2]) == b""  # a cut header
    too_big = _raw(server.address, REQUEST_HEADER.pack(MAGIC, MAX_REQUEST_BYTES + 1))
    kind, length, _ = FRAME.unpack_from(too_big)
    assert kind == ERROR and b"at most" in too_big[FRAME.size : FRAME.size + length]
    junk = b"\xc1\xff\x00" * 10
    reply = _raw(server.address, REQUEST_HEADER.pack(MAGIC, len(junk)) + junk)
    kind, length, _ = FRAME.unpack_from(reply)
    assert kind == ERROR and reply[FRAME.size :].startswith(b"bad request")
    got = Collect()
    transport.fetch(server.address, INSTANCE, "host", [7], source.block_bytes, got)
    assert got.blocks == {0: source.expected("host", 7)}


def test_advertised_address(source: TensorSource) -> None:
    server = TransferServer(source, INSTANCE, host="0.0.0.0", advertise_host="10.1.2.3")
    try:
        assert server.address == f"10.1.2.3:{server._sock.getsockname()[1]}"
    finally:
        server.close()
    server = TransferServer(source, INSTANCE, host="0.0.0.0")
    try:
        assert not server.address.startswith("0.0.0.0:")
    finally:
        server.close()


def test_loopback_bandwidth() -> None:
    assert loopback_bandwidth(1 << 20) > 0
