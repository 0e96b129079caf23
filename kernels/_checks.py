"""Layout checks shared by the thin wrappers around the Triton kernels.

Each wrapper validates what its kernel assumes (device, dtype, rank, unit stride on the last
dim) and raises ValueError with the tensor's name otherwise, so a bad call fails in Python
instead of reading the wrong memory on the device.
"""

from __future__ import annotations

import os

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def check_device(*tensors: torch.Tensor) -> None:
    """All tensors on one device: CUDA, or CPU when the Triton interpreter is on."""
    device = tensors[0].device
    for t in tensors:
        if t.device != device:
            raise ValueError(f"tensors on different devices: {device} and {t.device}")
    if device.type == "cuda":
        return
    if device.type != "cpu" or not interpreting():
        raise ValueError(
            f"Triton kernels need CUDA tensors (or CPU tensors with TRITON_INTERPRET=1); "
            f"got {device}"
        )


def check(
    t: torch.Tensor,
    name: str,
    ndim: int,
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES,
    last_contiguous: bool = True,
) -> None:
    """Rank, dtype and (by default) unit stride on the last dim."""
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dims, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name}: dtype {t.dtype} not in {dtypes}")
    if last_contiguous and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}: last dim must have stride 1, strides {t.stride()}")


def check_shape(t: torch.Tensor, name: str, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {tuple(t.shape)}")


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
