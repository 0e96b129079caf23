"""Attention backends over one paged KV cache layout, chosen by device."""

from __future__ import annotations

import torch

from services.worker.attention.base import AttentionBackend, AttentionMetadata


def get_attention_backend(device: torch.device) -> AttentionBackend:
    """Triton kernels on CUDA, the CPU backend elsewhere (the C++ CPU ops where they run);
    the model code never changes."""
    if device.type == "cuda":
        from services.worker.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    from services.worker.attention.cpu_backend import CpuAttentionBackend

    return CpuAttentionBackend()


__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]
