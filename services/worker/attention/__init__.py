"""Attention backends over one paged KV cache layout, chosen by device."""

from __future__ import annotations

import torch

from services.worker.attention.base import AttentionBackend, AttentionMetadata


def get_attention_backend(device: torch.device) -> AttentionBackend:
    """Triton kernels on CUDA, the C++ CPU ops where they run, plain torch elsewhere; the
    model code never changes."""
    if device.type == "cuda":
        from services.worker.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    from kernels import cpu_ops

    if device.type == "cpu" and cpu_ops.load():
        from services.worker.attention.cpu_ops_backend import CpuOpsAttentionBackend

        return CpuOpsAttentionBackend()
    from services.worker.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend()


__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]
