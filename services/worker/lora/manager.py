"""A runner's adapters: each step's requests get their adapter's slot, the adapters not held
read off their checkpoints first (into the least recently used slots no request of the step
needs)."""

from __future__ import annotations

import logging
import time
from collections.abc import Collection

import torch
from torch import nn

from services.worker.lora.checkpoint import read_adapter
from services.worker.lora.slots import SlotTable
from services.worker.lora.weights import LoRAStep, LoRAWeights
from services.worker.model_config import ModelConfig
from shared.wire import LoRARequest

log = logging.getLogger("skiff.worker")


class LoRAManager:
    """The adapter slots of `model` (read from `model_dir`): `max_loras` adapters at once, of
    rank up to `max_rank`."""

    def __init__(
        self,
        model: nn.Module,
        mc: ModelConfig,
        model_dir: str,
        max_loras: int,
        max_rank: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.mc, self.model_dir = mc, model_dir
        self.max_loras, self.max_rank = max_loras, max_rank
        self.weights = LoRAWeights(model, mc, max_loras, max_rank, device, dtype)
        self.slots = SlotTable(max_loras)
        self._paths: dict[str, str] = {}  # the directory each held adapter was read from
        self.num_loads = 0  # adapters read into a slot
        self.load_seconds = 0.0  # the time those reads took

    @property
    def step(self) -> LoRAStep:
        return self.weights.step

    def check(self, lora: LoRARequest) -> None:
        """Read `lora` as `load` would, into no slot; raises `LoRAError`."""
        read_adapter(lora, self.mc, self.max_rank, self.model_dir)

    def ensure_loaded(self, lora: LoRARequest, step: Collection[str] = ()) -> int:
        """The slot of `lora`, read into one first unless held (from the same directory),
        never into the slot of an adapter named in `step`; raises `LoRAError`."""
        if lora.lora_name in self.slots and self._paths.get(lora.lora_name) == lora.lora_path:
            return self.slots.use(lora.lora_name)
        self.slots.release(lora.lora_name)  # held from another directory: read again
        return self.load(lora, step)

    def load(self, lora: LoRARequest, step: Collection[str] = ()) -> int:
        """Read `lora` into a slot (not one of the adapters named in `step`); its slot."""
        start = time.perf_counter()
        adapter = read_adapter(lora, self.mc, self.max_rank, self.model_dir)
        slot = self.slots.claim(lora.lora_name, step)
        try:
            self.weights.write(slot, adapter)
        except BaseException:
            self.slots.release(lora.lora_name)
            self._paths.pop(lora.lora_name, None)
            raise
        self._paths[lora.lora_name] = lora.lora_path
        self.num_loads += 1
        self.load_seconds += time.perf_counter() - start
        log.info(
            "LoRA adapter %s (rank %d, %s) in slot %d: %.0f ms",
            lora.lora_name,
            adapter.rank,
            lora.lora_path,
            slot,
            (time.perf_counter() - start) * 1e3,
        )
        return slot
