"""The host-memory KV tier: slots of one block each, pinned on CUDA so that copies to and from
the device run without blocking the host."""

from __future__ import annotations

import torch

from services.worker.kv_tiers.slots import runs


class HostPool:
    """`num_slots` blocks of `block_shape` ([num_layers, 2, block_size, kv_heads, head_dim]).

    On CUDA, stores are asynchronous on the current stream: anything that reads a slot on the
    host (`snapshot`, `read`) first waits for the stores recorded before it."""

    def __init__(
        self, num_slots: int, block_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        # [num_slots, num_layers, 2, block_size, kv_heads, head_dim]; a slot is read only
        # after a store wrote it, so empty (not zeros: no pass over the whole pool)
        self.slots = torch.empty((num_slots, *block_shape), dtype=dtype, pin_memory=self.cuda)
        self._stored: torch.cuda.Event | None = None  # after the latest stores (CUDA)

    @property
    def num_slots(self) -> int:
        return self.slots.shape[0]

    def store(self, blocks: torch.Tensor, slots: list[int]) -> None:
        """slots[i] = blocks[i] for `blocks` [n, *block_shape] on the device: on CUDA without
        blocking, in the current stream's order."""
        if not self.cuda:
            self.slots.index_copy_(0, torch.tensor(slots, dtype=torch.int64), blocks)
            return
        for pos, first, n in runs(slots):
            self.slots[first : first + n].copy_(blocks[pos : pos + n], non_blocking=True)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(self.device))
        self._stored = event

    def synced(self) -> None:
        """Wait until every store so far reached host memory."""
        event = self._stored
        if event is not None:
            event.synchronize()

    def snapshot(self, slots: list[int]) -> torch.Tensor:
        """[n, *block_shape] copy of `slots` on the host, once their stores are done."""
        self.synced()
        return self.slots[torch.tensor(slots, dtype=torch.int64)]

    def to_device(self, slots: list[int]) -> torch.Tensor:
        """[n, *block_shape] copy of `slots` on the device, in the current stream's order."""
        if not self.cuda:
            return self.snapshot(slots)
        shape = (len(slots), *self.slots.shape[1:])
        out = torch.empty(shape, dtype=self.slots.dtype, device=self.device)
        for pos, first, n in runs(slots):
            out[pos : pos + n].copy_(self.slots[first : first + n], non_blocking=True)
        return out
