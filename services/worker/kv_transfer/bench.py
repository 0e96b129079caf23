"""KV transfer speed against a plain loopback TCP connection:
`python -m services.worker.kv_transfer.bench` (SmolLM2-135M fp32 blocks of 16 tokens)."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Iterator

import numpy as np

from services.worker.kv_transfer import TcpTransport, TransferServer, loopback_bandwidth

BLOCK_BYTES = 30 * 2 * 16 * 3 * 64 * 4  # [layers, K/V, block_size, kv_heads, head_dim] fp32


class ArraySource:
    """Blocks of one tier, rows of a [num_blocks, block_bytes] uint8 array."""

    def __init__(self, blocks: np.ndarray) -> None:
        self.blocks = blocks

    def read_blocks(self, tier: str, indices: list[int]) -> Iterator[memoryview]:
        return (memoryview(self.blocks[i]) for i in indices)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--blocks", type=int, default=64, help="blocks per fetch")
    parser.add_argument("--block-bytes", type=int, default=BLOCK_BYTES)
    parser.add_argument("--repeats", type=int, default=10, help="timed runs of each (median)")
    args = parser.parse_args()
    n, size = args.blocks, args.block_bytes
    blocks = np.random.default_rng(0).integers(0, 256, (n, size), dtype=np.uint8)
    dst = np.empty_like(blocks)  # [n, block_bytes]: where fetched blocks are copied

    def copy(i: int, payload: memoryview) -> None:
        dst[i] = np.frombuffer(payload, dtype=np.uint8)

    def drop(i: int, payload: memoryview) -> None:
        pass

    server = TransferServer(ArraySource(blocks), "bench")
    server.start()
    transport = TcpTransport()
    indices = list(range(n))

    def fetch(out: Callable[[int, memoryview], None]) -> float:
        start = time.perf_counter()
        moved = transport.fetch(server.address, "bench", "host", indices, size, out)
        return moved / (time.perf_counter() - start)

    rates: dict[str, list[float]] = {"copy": [], "drop": [], "loopback": []}
    try:
        fetch(copy)  # warm up
        for _ in range(args.repeats):  # interleaved: a change of load hits all three alike
            rates["copy"].append(fetch(copy))
            rates["drop"].append(fetch(drop))
            rates["loopback"].append(loopback_bandwidth())
        assert np.array_equal(dst, blocks)
    finally:
        transport.close()
        server.close()
    rate = {k: statistics.median(v) for k, v in rates.items()}
    loop = rate["loopback"]
    print(f"{n} blocks of {size} bytes, median of {args.repeats} runs:")
    print(f"loopback TCP (256 MiB):       {loop / 1e9:.2f} GB/s")
    print(f"fetch:                        {rate['drop'] / 1e9:.2f} GB/s")
    print(f"fetch, each block copied out: {rate['copy'] / 1e9:.2f} GB/s", end=" ")
    print(f"({rate['copy'] / loop:.2f} of loopback)")
    print(f"kv transfer / loopback: {rate['drop'] / loop:.2f}")


if __name__ == "__main__":
    main()
