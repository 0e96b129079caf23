"""CUDA graphs for decode-only steps: one captured forward per batch-size bucket.

A decode step of n requests is padded to the next bucket B: the padding rows get token 0,
position 0, slot -1 (the KV write skips them) and a one-token context, and their outputs are
dropped. Inputs are copied into static buffers that the captured kernels read, so a replay
costs a few copies and one launch instead of hundreds of kernel launches from Python.
"""

from __future__ import annotations

import bisect
import logging

import torch

from services.worker.attention import AttentionMetadata

log = logging.getLogger("skiff.worker.cuda_graphs")

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class DecodeGraphs:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        max_num_seqs: int,
        max_blocks_per_seq: int,
        max_model_len: int,
        device: torch.device,
        buckets: tuple[int, ...] = DEFAULT_BUCKETS,
    ) -> None:
        self.model, self.kv_caches = model, kv_caches
        self.max_model_len = max_model_len
        self.buckets = tuple(b for b in buckets if b <= max_num_seqs) or (max_num_seqs,)
        n = self.buckets[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)  # [max_bucket]
        self.positions = torch.zeros(n, dtype=torch.long, device=device)  # [max_bucket]
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)  # [max_bucket]
        # [max_bucket, max_blocks_per_seq]
        self.block_table = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def bucket_for(self, num_reqs: int) -> int | None:
        i = bisect.bisect_left(self.buckets, num_reqs)
        return self.buckets[i] if i < len(self.buckets) else None

    def static_meta(self, bucket: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: bucket + 1],
            seq_lens=self.seq_lens[:bucket],
            block_table=self.block_table[:bucket],
            slot_mapping=self.slot_mapping[:bucket],
            max_query_len=1,
            max_seq_len=self.max_model_len,  # a tiling hint only; covers every replay
            query_lens_cpu=[1] * bucket,
            seq_lens_cpu=self.seq_lens[:bucket].tolist() if not self.seq_lens.is_cuda else [],
        )

    def forward_static(self, bucket: int) -> torch.Tensor:
        """The forward pass over the static buffers (what gets captured)."""
        hidden: torch.Tensor = self.model(
            self.input_ids[:bucket],
            self.positions[:bucket],
            self.kv_caches,
            self.static_meta(bucket),
        )
        return hidden

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        for bucket in reversed(self.buckets):  # largest first so smaller ones share its pool
            self.forward_static(bucket)  # warm-up: compiles kernels outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bucket] = self.forward_static(bucket)
            pool = graph.pool()
            self.graphs[bucket] = graph
        log.info("captured decode CUDA graphs for batch sizes %s", self.buckets)

    def load(
        self,
        input_ids: torch.Tensor,  # [n]
        positions: torch.Tensor,  # [n]
        meta: AttentionMetadata,
        bucket: int,
    ) -> None:
        """Copy one decode step into the static buffers, padding rows n..bucket-1."""
        n, width = input_ids.shape[0], meta.block_table.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.block_table[:n, :width].copy_(meta.block_table)
        self.input_ids[n:bucket].zero_()
        self.positions[n:bucket].zero_()
        self.slot_mapping[n:bucket].fill_(-1)
        self.seq_lens[n:bucket].fill_(1)
        self.block_table[n:bucket].zero_()

    def run(
        self,
        input_ids: torch.Tensor,  # [n]
        positions: torch.Tensor,  # [n]
        meta: AttentionMetadata,
    ) -> torch.Tensor | None:
        """Hidden states [n, hidden] of a decode-only step, or None if no graph fits it."""
        n = input_ids.shape[0]
        bucket = self.bucket_for(n)
        if meta.max_query_len != 1 or bucket not in self.graphs:
            return None
        self.load(input_ids, positions, meta, bucket)
        self.graphs[bucket].replay()
        return self.outputs[bucket][:n]
