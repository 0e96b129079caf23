"""Which LoRA adapter slot each token of a step runs with, built once per step and shared by
every LoRA-carrying projection of the model (`ops.add_lora`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

NO_LORA = -1  # the slot index of a token of the base model


@dataclass(frozen=True)
class LoRAMapping:
    """`token_lora_indices` [num_tokens] int64: each token's adapter slot (`NO_LORA`: none);
    `groups`: (slot, rows [n] int64) for each slot the step uses, rows in token order (the
    torch path multiplies each adapter's rows at once); `token_slots`: the slots as int32 on
    the host (the C++ CPU op's)."""

    token_lora_indices: torch.Tensor
    groups: tuple[tuple[int, torch.Tensor], ...]
    token_slots: torch.Tensor

    @classmethod
    def build(cls, token_lora_indices: torch.Tensor) -> LoRAMapping:
        indices = token_lora_indices.to(torch.int64)
        host = indices.cpu()
        slots = [int(s) for s in torch.unique(host).tolist() if s != NO_LORA]
        groups = tuple(
            (slot, torch.nonzero(host == slot).flatten().to(indices.device)) for slot in slots
        )
        return cls(indices, groups, host.to(torch.int32))

    @property
    def active(self) -> bool:
        """Whether any token runs with an adapter."""
        return bool(self.groups)
