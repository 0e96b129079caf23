"""KV transfer: one worker fetches KV blocks kept by another over TCP.

A block's payload is the bytes of one KV block over all layers, a contiguous
[num_layers, 2, block_size, num_kv_heads, head_dim] tensor. A worker serves its tiers with a
`TransferServer` over a `BlockSource`; another fetches with a `KVTransport` (`TcpTransport`),
which hands each block to its caller as soon as it arrived and verified.

Protocol (version 1; all integers big-endian):

- request: ``"SKVT"``, u32 length, then that many bytes of a msgpack array
  ``[version, instance_id, tier, indices, block_bytes]`` (`protocol.FetchRequest`; at most
  65536 indices and 1 MiB).
- reply: frames of u8 kind, u32 length, u64 checksum, then `length` bytes. First a status
  frame: OK (no body) or ERROR / INTEGRITY_ERROR with a UTF-8 message (wrong instance, unknown
  tier, index out of range, a stored block that failed its own check at the source); after OK
  one BLOCK frame per index, in order, the body the block's payload and the checksum its
  xxh3-64. An ERROR or INTEGRITY_ERROR frame in place of a block ends the reply.
- A connection carries any number of request/reply pairs in turn; the server closes one idle
  for 60 s, or that sent something other than a request.

The server refuses a request for another instance id: a restarted worker at the same address
never serves blocks of the process it replaced. The client verifies each block's checksum
(`KVIntegrityError` on a mismatch) before passing it on.
"""

from services.worker.kv_transfer.client import TcpTransport
from services.worker.kv_transfer.loopback import loopback_bandwidth
from services.worker.kv_transfer.protocol import (
    BlockSource,
    KVIntegrityError,
    KVTransferError,
    KVTransport,
    checksum,
)
from services.worker.kv_transfer.server import TransferServer

__all__ = [
    "BlockSource",
    "KVIntegrityError",
    "KVTransferError",
    "KVTransport",
    "TcpTransport",
    "TransferServer",
    "checksum",
    "loopback_bandwidth",
]
