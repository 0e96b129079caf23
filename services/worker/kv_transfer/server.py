"""The server side of KV transfer: serves a BlockSource's blocks, one thread per connection."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Iterator

import msgspec

from services.worker.kv_transfer.protocol import (
    BLOCK,
    ERROR,
    FRAME,
    INTEGRITY_ERROR,
    MAGIC,
    MAX_MESSAGE_BYTES,
    MAX_REQUEST_BYTES,
    OK,
    REQUEST_HEADER,
    VERSION,
    BlockSource,
    FetchRequest,
    KVIntegrityError,
    checksum,
    decode_request,
    recv_all,
    recv_exact,
    send_frame,
    tune,
)

log = logging.getLogger("skiff.worker.kv_transfer")

IDLE_TIMEOUT_S = 60.0  # a connection without a request for this long is closed
IO_TIMEOUT_S = 30.0  # the longest one read or write of a request or reply may wait
_ANY_HOST = ("", "0.0.0.0", "::")


class _Refusal(Exception):
    """The source cannot serve a request: sent as an error frame of `kind`."""

    def __init__(self, kind: int, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class TransferServer:
    """Serves `source`'s blocks to fetches naming `instance_id`, at `host`:`port` (0: any free
    port), advertised as `advertise_host`."""

    def __init__(
        self,
        source: BlockSource,
        instance_id: str,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
    ) -> None:
        self.source, self.instance_id = source, instance_id
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.create_server((host, port), family=family, backlog=128)
        if advertise_host is None:
            advertise_host = _host_ip() if host in _ANY_HOST else host
        port = self._sock.getsockname()[1]
        bracketed = f"[{advertise_host}]" if ":" in advertise_host else advertise_host
        self._address = f"{bracketed}:{port}"
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._closed = False
        self._bytes_served = 0
        self._acceptor: threading.Thread | None = None

    @property
    def address(self) -> str:
        """host:port where others reach this server."""
        return self._address

    @property
    def bytes_served(self) -> int:
        """Payload bytes sent since the start."""
        return self._bytes_served

    def start(self) -> None:
        self._acceptor = threading.Thread(
            target=self._accept_loop, name="kv-transfer-accept", daemon=True
        )
        self._acceptor.start()

    def close(self) -> None:
        """Stop accepting and cut every open connection (a reply in flight fails)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns = list(self._conns)
        for sock in [self._sock, *conns]:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in accept or recv
        self._sock.close()
        if self._acceptor is not None:
            self._acceptor.join(timeout=5.0)

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError as exc:
                if self._closed:
                    return
                log.warning("KV transfer server: accept failed: %s", exc)
                threading.Event().wait(0.1)
                continue
            threading.Thread(
                target=self._serve, args=(conn,), name="kv-transfer-conn", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        with self._lock:
            if self._closed:
                conn.close()
                return
            self._conns.add(conn)
        try:
            tune(conn)
            while self._serve_one(conn):
                pass
        except OSError as exc:
            log.debug("KV transfer connection ended: %s", exc)
        except Exception:
            log.exception("KV transfer connection failed")
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _serve_one(self, conn: socket.socket) -> bool:
        """Answer one request; False when the connection is to be closed."""
        header = bytearray(REQUEST_HEADER.size)
        conn.settimeout(IDLE_TIMEOUT_S)
        got = recv_exact(conn, memoryview(header))
        if got == 0:
            return False  # the client closed it
        conn.settimeout(IO_TIMEOUT_S)
        if got < len(header):
            return False
        magic, length = REQUEST_HEADER.unpack(header)
        if magic != MAGIC:
            log.debug("KV transfer server: not a request (%r); closing", bytes(header))
            return False
        if length > MAX_REQUEST_BYTES:
            _send_message(conn, ERROR, f"a request of {length} bytes (at most {MAX_REQUEST_BYTES})")
            return False
        body = bytearray(length)
        recv_all(conn, memoryview(body))
        try:
            request = decode_request(body)
        except msgspec.DecodeError as exc:
            _send_message(conn, ERROR, f"bad request: {exc}")
            return True
        if request.version != VERSION:
            _send_message(conn, ERROR, f"protocol version {request.version}, serving {VERSION}")
        elif request.instance_id != self.instance_id:
            _send_message(
                conn, ERROR, f"wrong instance {request.instance_id!r}: this is {self.instance_id!r}"
            )
        else:
            self._reply(conn, request)
        return True

    def _reply(self, conn: socket.socket, request: FetchRequest) -> None:
        started = False
        try:
            for data in self._payloads(request):
                if not started:
                    conn.sendall(FRAME.pack(OK, 0, 0))
                    started = True
                with self._lock:  # counted first: a client never holds bytes not yet counted
                    self._bytes_served += data.nbytes
                self._send_block(conn, data, checksum(data))
        except _Refusal as exc:
            _send_message(conn, exc.kind, str(exc))
            return
        if not started:
            conn.sendall(FRAME.pack(OK, 0, 0))  # no blocks asked for

    def _send_block(self, conn: socket.socket, data: memoryview, digest: int) -> None:
        send_frame(conn, FRAME.pack(BLOCK, data.nbytes, digest), data)

    def _payloads(self, request: FetchRequest) -> Iterator[memoryview]:
        """The source's payloads for `request` as byte views of its block size; what the
        source fails with as _Refusal."""
        n = len(request.indices)
        try:
            blocks = iter(self.source.read_blocks(request.tier, request.indices))
        except Exception as exc:
            raise _refusal(exc) from exc
        for i in range(n):
            try:
                data = _byte_view(next(blocks))
            except StopIteration:
                raise _Refusal(ERROR, f"the source gave {i} of {n} blocks") from None
            except Exception as exc:
                raise _refusal(exc) from exc
            if data.nbytes != request.block_bytes:
                raise _Refusal(
                    ERROR, f"blocks here are {data.nbytes} bytes, not {request.block_bytes}"
                )
            yield data


def _refusal(exc: Exception) -> _Refusal:
    """The error frame for what the source raised."""
    if isinstance(exc, KVIntegrityError):
        return _Refusal(INTEGRITY_ERROR, str(exc))
    if isinstance(exc, LookupError):
        return _Refusal(ERROR, str(exc) or type(exc).__name__)
    log.warning("KV transfer server: the block source failed", exc_info=exc)
    return _Refusal(ERROR, f"{type(exc).__name__}: {exc}")


def _byte_view(data: memoryview | bytes) -> memoryview:
    """A flat byte view of a payload (no copy)."""
    view = memoryview(data)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _send_message(conn: socket.socket, kind: int, message: str) -> None:
    body = message.encode(errors="replace")[:MAX_MESSAGE_BYTES]
    conn.sendall(FRAME.pack(kind, len(body), 0) + body)


def _host_ip() -> str:
    """This machine's address by its hostname (127.0.0.1 when it does not resolve)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
