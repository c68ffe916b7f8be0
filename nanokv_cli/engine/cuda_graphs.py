"""Decode steps on CUDA as captured graphs, for a ladder of batch sizes (as nano-vllm does).

A decode step's kernels are launched once at capture and replayed after: the launch overhead of
a small model's few hundred kernels per step is most of a step otherwise. Padding rows of a
replayed batch write their K/V into one extra cache block that is never handed out.
"""

from __future__ import annotations

import torch
from torch import nn

from .layers.attention import AttentionMetadata, FlashMetadata


class DecodeGraphs:  # pragma: no cover - GPU
    """Captured decode forwards of ``model``, one per batch size of the ladder."""

    def __init__(
        self,
        model: nn.Module,
        *,
        max_num_seqs: int,
        width: int,
        scratch_slot: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        max_bs = min(max_num_seqs, 512)
        self.scratch_slot = scratch_slot
        self.inputs = {
            "input_ids": torch.zeros(max_bs, dtype=torch.long, device=device),
            "positions": torch.zeros(max_bs, dtype=torch.long, device=device),
            "slot_mapping": torch.full((max_bs,), scratch_slot, dtype=torch.long, device=device),
            "context_lens": torch.zeros(max_bs, dtype=torch.int32, device=device),
            "block_tables": torch.zeros(max_bs, width, dtype=torch.int32, device=device),
            "outputs": torch.zeros(max_bs, hidden_size, dtype=dtype, device=device),
        }
        ladder = {1, 2, 4, 8, *range(16, max_bs + 1, 16), max_bs}
        self.sizes = sorted(b for b in ladder if b <= max_bs)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._capture(model)

    def covers(self, rows: int) -> bool:
        return rows <= self.sizes[-1]

    def _capture(self, model: nn.Module) -> None:
        g = self.inputs
        pool = None
        with torch.inference_mode():
            for b in reversed(self.sizes):
                meta = self._meta(b)
                g["outputs"][:b] = model(g["input_ids"][:b], g["positions"][:b], meta)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool):
                    g["outputs"][:b] = model(g["input_ids"][:b], g["positions"][:b], meta)
                if pool is None:
                    pool = graph.pool()
                self.graphs[b] = graph
                torch.cuda.synchronize()

    def _meta(self, b: int) -> AttentionMetadata:
        g = self.inputs
        return AttentionMetadata(
            slot_mapping=g["slot_mapping"][:b],
            flash=FlashMetadata(
                decode_only=True,
                context_lens=g["context_lens"][:b],
                block_tables=g["block_tables"][:b],
            ),
        )

    def replay(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        n = len(input_ids)
        b = next(size for size in self.sizes if size >= n)
        g = self.inputs
        flash = meta.flash
        g["input_ids"][:n] = input_ids
        g["positions"][:n] = positions
        g["slot_mapping"].fill_(self.scratch_slot)
        g["slot_mapping"][:n] = meta.slot_mapping
        g["context_lens"].zero_()
        g["context_lens"][:n] = flash.context_lens
        if flash.block_tables is not None:
            g["block_tables"][:n, : flash.block_tables.shape[1]] = flash.block_tables
        self.graphs[b].replay()
        return g["outputs"][:n]
