"""SiLU-and-mul (the gated MLP activation) as a Triton kernel; see reference.silu_and_mul."""

from __future__ import annotations

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from kernels._checks import check, check_device

BLOCK = 1024


@triton.jit  # type: ignore[untyped-decorator]
def _silu_and_mul_kernel(
    x_ptr: tl.tensor,  # [num_tokens, 2 * d]: gate | up
    out_ptr: tl.tensor,  # [num_tokens, d]
    d: tl.tensor,
    stride_x: tl.tensor,
    stride_out: tl.tensor,
    BLOCK: tl.constexpr,
) -> None:
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + token * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + token * stride_x + d + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g * tl.sigmoid(g)).to(gate.dtype)  # rounded like torch's silu in x.dtype
    out = act.to(tl.float32) * up.to(tl.float32)  # fp32 math, one rounding on store
    tl.store(out_ptr + token * stride_out + cols, out.to(gate.dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, 2 * d] (gate | up) -> [num_tokens, d] = silu(gate) * up.

    Inputs of other ranks split their last dim, like the reference.
    """
    if x.dim() != 2 and x.dim() > 0:
        return silu_and_mul(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], x.shape[-1] // 2)
    check(x, "x", 2)
    check_device(x)
    num_tokens, d = x.shape[0], x.shape[1] // 2
    if x.shape[1] % 2:
        raise ValueError(f"x: last dim must be even, got {x.shape[1]}")
    out = torch.empty(num_tokens, d, dtype=x.dtype, device=x.device)  # [num_tokens, d]
    if num_tokens == 0 or d == 0:
        return out
    block = min(BLOCK, triton.next_power_of_2(d))
    grid = (num_tokens, triton.cdiv(d, block))
    _silu_and_mul_kernel[grid](x, out, d, x.stride(0), out.stride(0), BLOCK=block)
    return out
