"""The adapters' weights on the model: each LoRA-carrying projection holds one stacked pair
of tensors with a row per adapter slot, and `layers.project` adds the update of the step's
adapters (`ops.add_lora`) when `LoRAStep.mapping` is set.

A fused projection's slices share the pair: slice i's lora_a rows [i*R, (i+1)*R) and lora_b
block [slice i's outputs, i*R:(i+1)*R), R = max_lora_rank, zero elsewhere; an adapter of a
lower rank fills its first columns, one without the slice or layer leaves them zero. On the CPU
(fp32, the C++ ops) lora_b holds only the slices' blocks, each [slice's outputs, R] in panels
of 16 outputs, slice after slice, as `skiff_cpu::add_lora` reads them
(`ops.cpu_lora_panels`): the expand reads no zero blocks."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from kernels import cpu_ops
from kernels.lora_mapping import LoRAMapping
from kernels.ops import cpu_lora_panels
from services.worker.lora.checkpoint import LoRAAdapter
from services.worker.lora.targets import TARGETS, ModuleShape, module_shapes
from services.worker.model_config import ModelConfig
from shared.arith import cdiv

MODULE_ATTR = "lora"  # a projection's ModuleLoRA, which `layers.project` reads


class LoRAStep:
    """The running step's adapter mapping, shared by every LoRA-carrying projection (None:
    no token of the step runs with an adapter, the projections skip LoRA)."""

    def __init__(self) -> None:
        self.mapping: LoRAMapping | None = None

    @contextmanager
    def use(self, mapping: LoRAMapping) -> Iterator[None]:
        """`mapping` for the duration of one forward."""
        self.mapping = mapping
        try:
            yield
        finally:
            self.mapping = None


class ModuleLoRA:
    """One projection's adapter weights, set on the module as `module.lora`."""

    def __init__(
        self,
        step: LoRAStep,
        shape: ModuleShape,
        max_loras: int,
        max_rank: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.step = step
        self.max_rank = max_rank
        self.slice_sizes = shape.slice_sizes
        n, out = len(shape.slice_sizes), sum(shape.slice_sizes)
        self.lora_a = torch.zeros(
            max_loras, n * max_rank, shape.in_features, device=device, dtype=dtype
        )  # [S, n R, in]
        self.panels = cpu_lora_panels(device, dtype, shape.in_features)
        # slice i's rows of lora_b (outputs, or panels of 16): [slice_starts[i], slice_starts[i+1])
        rows = [cdiv(size, cpu_ops.PANEL) if self.panels else size for size in self.slice_sizes]
        self.slice_starts = [sum(rows[:i]) for i in range(n + 1)]
        b_shape = (sum(rows), max_rank, cpu_ops.PANEL) if self.panels else (out, n * max_rank)
        # [S, sum(ceil(slice / 16)), R, 16] panels, or [S, out, n R]
        self.lora_b = torch.zeros(max_loras, *b_shape, device=device, dtype=dtype)

    def clear(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()

    def write(self, slot: int, index: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Slice `index`'s a [rank, in] and b [out_slice, rank] into `slot` (cleared)."""
        rank, cols = a.shape[0], index * self.max_rank
        rows = slice(self.slice_starts[index], self.slice_starts[index + 1])
        self.lora_a[slot, cols : cols + rank] = a
        if self.panels:
            panels = cpu_ops.pack_panels(b)  # [ceil(out_slice / 16), rank, 16]
            self.lora_b[slot, rows, :rank] = panels
        else:
            self.lora_b[slot, rows, cols : cols + rank] = b


class LoRAWeights:
    """Every LoRA-carrying projection of `model` (a DecoderForCausalLM), with `max_loras`
    slots of rank up to `max_rank` each."""

    def __init__(
        self,
        model: nn.Module,
        mc: ModelConfig,
        max_loras: int,
        max_rank: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.step = LoRAStep()
        self.modules: dict[tuple[int, str], ModuleLoRA] = {}
        for name, shape in module_shapes(mc).items():
            for layer in range(mc.num_hidden_layers):
                module = model.get_submodule(f"layers.{layer}.{name}")
                lora = ModuleLoRA(self.step, shape, max_loras, max_rank, device, dtype)
                setattr(module, MODULE_ATTR, lora)
                self.modules[layer, name] = lora

    def write(self, slot: int, adapter: LoRAAdapter) -> None:
        """`adapter` into `slot`, replacing what it held."""
        for lora in self.modules.values():
            lora.clear(slot)
        for (layer, target), (a, b) in adapter.weights.items():
            name, index = TARGETS[target]
            lora = self.modules[layer, name]
            lora.write(slot, index, a, b)
