"""Device dispatch: the model calls these; CUDA tensors run Triton kernels, CPU tensors the
C++ CPU ops (kernels/cpu_ops.py) where they are loaded, others the plain-torch reference.

With the Triton interpreter on (TRITON_INTERPRET=1) and `use_triton_on_cpu(True)` called, CPU
tensors run the Triton kernels in the interpreter instead, which is how the tests drive the
whole model through the kernels.
Kernel modules are imported on first use, so the CPU path never imports Triton.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.nn import functional as F

from kernels import cpu_ops, reference
from kernels._checks import interpreting
from kernels.lora_mapping import LoRAMapping

_triton_on_cpu = False


def use_triton_on_cpu(enabled: bool) -> None:
    """Route CPU tensors to the Triton kernels (honoured only under TRITON_INTERPRET=1)."""
    global _triton_on_cpu
    _triton_on_cpu = enabled


def use_triton(t: torch.Tensor) -> bool:
    """Whether an op on `t` runs the Triton kernel rather than the reference."""
    if t.is_cuda:
        return True
    return _triton_on_cpu and t.device.type == "cpu" and interpreting()


def use_cpu_ops(x: torch.Tensor) -> bool:
    """Whether an op on `x` runs the C++ CPU op (kernels/cpu_ops.py) rather than the reference."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and cpu_ops.active()


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
    packed_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., in] @ weight[out, in]^T + bias -> [..., out]. On the CPU, once `cpu_ops.load()`
    has succeeded, the C++ kernel: the panel kernel where `packed` holds the weight in panels
    (`cpu_ops.pack_panels`; int8 with its scales' panels `packed_scale`), else the row kernel
    (fp32, bf16, or int8 weights with their group scales `weight_scale` [out, in / 32]; it
    hands shapes it does not cover back to torch); `F.linear` elsewhere. A packed weight may be
    a meta placeholder (services/worker/weight_format.py pack_panels): torch's fallback then
    unpacks fp32 / bf16 panels per call."""
    if packed is not None and use_cpu_ops(x):
        y: torch.Tensor = torch.ops.skiff_cpu.linear_packed(
            x, packed, weight.shape[0], bias, packed_scale
        )
        return y
    if use_cpu_ops(x):
        out: torch.Tensor = torch.ops.skiff_cpu.linear(x, weight, bias, weight_scale)
        return out
    if weight.is_meta:  # F.linear would read whatever memory it is given
        if packed is None or packed.dim() != 3 or packed_scale is not None:
            raise ValueError("a meta weight runs only from its fp32 / bf16 panels")
        weight = cpu_ops.unpack_panels(packed, weight.shape[0])
    return F.linear(x, weight, bias)


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    mapping: LoRAMapping,
    slice_sizes: Sequence[int] | None = None,
) -> torch.Tensor:
    """y [num_tokens, out] += each token's adapter update lora_b[s] @ lora_a[s] @ x[t], in
    place; lora_a [num_slots, rank, in], lora_b [num_slots, out, rank], or on the CPU
    (`cpu_lora_panels`) per slice of `slice_sizes` (the outputs of each fused slice, adding
    up to out; None: one slice): lora_a [num_slots, n rank, in], slice i's rows
    [i rank, (i + 1) rank), and lora_b panels [num_slots, sum(ceil(slice / 16)), rank, 16],
    each slice's [slice, rank] packed by `cpu_ops.pack_panels`, slice after slice. Tokens
    without an adapter keep their bits. Triton (kernels/lora.py): one program per token,
    shrink then expand over mapping.token_lora_indices. Otherwise each adapter's tokens are
    multiplied together (by the C++ CPU op with panels), so a token's result does not depend
    on which other adapters share the step."""
    if use_triton(x):
        if not mapping.active:
            return y
        from kernels import lora as kernel

        return kernel.add_lora(y, x, lora_a, lora_b, mapping.token_lora_indices)
    if lora_b.dim() == 4:  # panels: the C++ op's
        sizes = list(slice_sizes or (y.shape[1],))
        torch.ops.skiff_cpu.add_lora(y, x.contiguous(), lora_a, lora_b, mapping.token_slots, sizes)
        return y
    for slot, rows in mapping.groups:
        shrunk = x.index_select(0, rows) @ lora_a[slot].t()  # [n, rank]
        y.index_add_(0, rows, shrunk @ lora_b[slot].t())
    return y


def cpu_lora_panels(device: torch.device, dtype: torch.dtype, in_features: int) -> bool:
    """Adapter weights of a projection with `in_features` inputs go to `skiff_cpu::add_lora`
    (their lora_b in panels per slice, `cpu_ops.pack_panels`): fp32 on the CPU with the C++
    ops, inputs in multiples of 16."""
    return (
        device.type == "cpu" and dtype == torch.float32 and in_features % 16 == 0 and cpu_ops.load()
    )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [num_tokens, hidden] -> (normed, x + residual); see reference.rms_norm."""
    if use_triton(x):
        from kernels import rms_norm as kernel

        return kernel.rms_norm(x, weight, eps, residual)
    if use_cpu_ops(x):
        normed: tuple[torch.Tensor, torch.Tensor] = torch.ops.skiff_cpu.rms_norm(
            x, weight, eps, residual
        )
        return normed
    return reference.rms_norm(x, weight, eps, residual)


def rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox rotary on [num_tokens, heads, head_dim] query/key; see reference.rotary_embedding."""
    if use_triton(query):
        from kernels import rotary as kernel

        return kernel.rotary_embedding(positions, query, key, cos_sin_cache)
    if use_cpu_ops(query):
        rotated: tuple[torch.Tensor, torch.Tensor] = torch.ops.skiff_cpu.rotary_embedding(
            positions, query, key, cos_sin_cache
        )
        return rotated
    return reference.rotary_embedding(positions, query, key, cos_sin_cache)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[num_tokens, 2 * d] -> [num_tokens, d]; see reference.silu_and_mul."""
    if use_triton(x):
        from kernels import activation as kernel

        return kernel.silu_and_mul(x)
    if use_cpu_ops(x):
        out: torch.Tensor = torch.ops.skiff_cpu.silu_and_mul(x)
        return out
    return reference.silu_and_mul(x)


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter [num_tokens, kv_heads, head_dim] into the paged cache; see reference."""
    if use_triton(kv_cache):
        from kernels import kv_cache as kernel

        return kernel.write_kv_cache(key, value, kv_cache, slot_mapping)
    return reference.write_kv_cache(key, value, kv_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """Causal attention against the paged cache; see reference.paged_attention.

    max_query_len / max_seq_len are host-side tiling hints for the Triton kernel.
    """
    if use_triton(query):
        from kernels import paged_attention as kernel

        return kernel.paged_attention(
            query, kv_cache, query_start_loc, seq_lens, block_table, scale,
            max_query_len=max_query_len, max_seq_len=max_seq_len,
        )  # fmt: skip
    return reference.paged_attention(query, kv_cache, query_start_loc, seq_lens, block_table, scale)
