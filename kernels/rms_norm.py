"""Fused residual add + RMSNorm as a Triton kernel; see reference.rms_norm."""

from __future__ import annotations

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from kernels._checks import check, check_device, check_shape

MAX_HIDDEN = 65536


@triton.jit  # type: ignore[untyped-decorator]
def _rms_norm_kernel(
    x_ptr: tl.tensor,  # [num_tokens, hidden]
    residual_ptr: tl.tensor,  # [num_tokens, hidden] (unused without HAS_RESIDUAL)
    weight_ptr: tl.tensor,  # [hidden]
    out_ptr: tl.tensor,  # [num_tokens, hidden]
    residual_out_ptr: tl.tensor,  # [num_tokens, hidden]: x + residual
    hidden: tl.tensor,
    eps: tl.tensor,
    stride_x: tl.tensor,
    stride_residual: tl.tensor,
    stride_out: tl.tensor,
    stride_residual_out: tl.tensor,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
) -> None:
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    dtype = x.dtype
    if HAS_RESIDUAL:  # add in fp32, round to x.dtype like torch does
        r = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(residual_out_ptr + row * stride_residual_out + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = (xf * rstd).to(dtype).to(tl.float32) * weight  # normed rounds to x.dtype first
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [num_tokens, hidden]; weight: [hidden] -> (normed, x + residual).

    Without a residual the second result is `x` itself, as in the reference. Inputs of other
    ranks are normalized over their last dim, like the reference.
    """
    if x.dim() != 2 and x.dim() > 0:
        return _rms_norm_nd(x, weight, eps, residual)
    check(x, "x", 2)
    check(weight, "weight", 1)
    num_tokens, hidden = x.shape
    check_shape(weight, "weight", (hidden,))
    if hidden > MAX_HIDDEN:
        raise ValueError(f"hidden size {hidden} > {MAX_HIDDEN}")
    tensors = [x, weight]
    if residual is not None:
        check(residual, "residual", 2, dtypes=(x.dtype,))
        check_shape(residual, "residual", (num_tokens, hidden))
        tensors.append(residual)
    check_device(*tensors)
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    out = torch.empty(num_tokens, hidden, dtype=out_dtype, device=x.device)  # [num_tokens, hidden]
    new_residual = x if residual is None else torch.empty_like(x)  # [num_tokens, hidden]
    if num_tokens == 0:
        return out, new_residual
    res = x if residual is None else residual
    _rms_norm_kernel[(num_tokens,)](
        x, res, weight, out, new_residual, hidden, eps,
        x.stride(0), res.stride(0), out.stride(0), new_residual.stride(0),
        HAS_RESIDUAL=residual is not None,
        BLOCK=triton.next_power_of_2(hidden),
        num_warps=_num_warps(hidden),
    )  # fmt: skip
    return out, new_residual


def _num_warps(hidden: int) -> int:
    block: int = triton.next_power_of_2(hidden)
    return min(16, max(1, block // 256))


def _rms_norm_nd(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """rms_norm over the last dim of a [..., hidden] tensor, through the 2-D kernel."""
    hidden = x.shape[-1]
    flat_residual = None if residual is None else residual.reshape(-1, hidden)
    normed, new_residual = rms_norm(x.reshape(-1, hidden), weight, eps, flat_residual)
    return normed.view(x.shape), x if residual is None else new_residual.view(x.shape)
