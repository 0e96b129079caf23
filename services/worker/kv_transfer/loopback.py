"""The speed of a plain TCP connection over loopback: the peer KV transfer is measured
against."""

from __future__ import annotations

import socket
import threading
import time

CHUNK_BYTES = 4 << 20  # one sendall / the receive buffer


def loopback_bandwidth(num_bytes: int = 256 << 20) -> float:
    """Bytes/s of a plain TCP socket pair moving `num_bytes` over 127.0.0.1 with large
    sendall / recv_into (default socket options)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        conn, _ = server.accept()
    chunk = memoryview(bytearray(CHUNK_BYTES))

    def send() -> None:
        left = num_bytes
        while left > 0:
            n = min(left, CHUNK_BYTES)
            conn.sendall(chunk[:n])
            left -= n

    buf = memoryview(bytearray(CHUNK_BYTES))
    with client, conn:
        sender = threading.Thread(target=send, name="loopback-send", daemon=True)
        start = time.perf_counter()
        sender.start()
        got = 0
        while got < num_bytes:
            k = client.recv_into(buf)
            if k == 0:
                raise ConnectionError(f"loopback closed after {got} of {num_bytes} bytes")
            got += k
        seconds = time.perf_counter() - start
        sender.join()
    return num_bytes / seconds
