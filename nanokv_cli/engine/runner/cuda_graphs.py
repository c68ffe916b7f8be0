"""Decode steps on CUDA as captured graphs, for a ladder of batch sizes (as nano-vllm does).

A decode step's kernels are launched once at capture and replayed after: the launch overhead of
a small model's few hundred kernels per step is most of a step otherwise. Padding rows of a
replayed batch write their K/V into one extra cache block that is never handed out, and attend
to nothing (context 0). The graphs hold the decode metadata of the flash-attn or the Triton back
end in static buffers; a replay copies the step's into them (``stage``), which is all a CPU
test needs to check what a replay computes without a GPU.
"""

from __future__ import annotations

import torch
from torch import nn

from ..layers.attention import AttentionMetadata, FlashMetadata
from .triton_attention import TritonMetadata, split_kv


class DecodeGraphs:
    """Decode forwards of ``model``, one per batch size of the ladder: static inputs, and the
    captured graphs once ``capture`` has run (CUDA)."""

    def __init__(
        self,
        *,
        attention: str,
        max_num_seqs: int,
        width: int,
        scratch_slot: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        kv_heads: int = 1,
        max_context: int = 0,
    ) -> None:
        """``attention``: "flash" or "triton", whose metadata the graphs hold. ``kv_heads``
        and ``max_context`` choose the Triton launch of each batch size (split-KV for small
        batches when contexts may grow long), fixed at capture."""
        max_bs = min(max_num_seqs, 512)
        self.attention, self.scratch_slot = attention, scratch_slot
        self.kv_heads, self.max_context = kv_heads, max_context
        rows = torch.arange(max_bs + 1, dtype=torch.int32, device=device)
        self.inputs = {
            "input_ids": torch.zeros(max_bs, dtype=torch.long, device=device),
            "positions": torch.zeros(max_bs, dtype=torch.long, device=device),
            "slot_mapping": torch.full((max_bs,), scratch_slot, dtype=torch.long, device=device),
            "context_lens": torch.zeros(max_bs, dtype=torch.int32, device=device),
            "block_tables": torch.zeros(max_bs, width, dtype=torch.int32, device=device),
            "outputs": torch.zeros(max_bs, hidden_size, dtype=dtype, device=device),
            # A decode row per sequence: row i is sequence i's, one query tile each.
            "query_start": rows,
            "tile_seq": rows[:-1],
            "tile_first": torch.zeros(max_bs, dtype=torch.int32, device=device),
        }
        ladder = {1, 2, 4, 8, *range(16, max_bs + 1, 16), max_bs}
        self.sizes = sorted(b for b in ladder if b <= max_bs)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def covers(self, rows: int) -> bool:
        return rows <= self.sizes[-1]

    def capture(self, model: nn.Module) -> DecodeGraphs:  # pragma: no cover - GPU
        g = self.inputs
        pool = None
        with torch.inference_mode():
            for b in reversed(self.sizes):
                meta = self.meta(b)
                g["outputs"][:b] = model(g["input_ids"][:b], g["positions"][:b], meta)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool):
                    g["outputs"][:b] = model(g["input_ids"][:b], g["positions"][:b], meta)
                if pool is None:
                    pool = graph.pool()
                self.graphs[b] = graph
                torch.cuda.synchronize()
        return self

    def meta(self, b: int) -> AttentionMetadata:
        """The metadata a graph of batch size ``b`` reads, views of the static buffers."""
        g = self.inputs
        meta = AttentionMetadata(slot_mapping=g["slot_mapping"][:b])
        if self.attention == "flash":
            meta.flash = FlashMetadata(
                decode_only=True,
                context_lens=g["context_lens"][:b],
                block_tables=g["block_tables"][:b],
            )
            return meta
        meta.triton = TritonMetadata(
            query_start=g["query_start"][: b + 1],
            context_lens=g["context_lens"][:b],
            block_tables=g["block_tables"][:b],
            tile_seq=g["tile_seq"][:b],
            tile_first=g["tile_first"][:b],
            num_splits=split_kv(b * self.kv_heads, self.max_context),
        )
        return meta

    def stage(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> int:
        """Copy a decode step of ``len(input_ids)`` rows into the static inputs; the batch size
        of the graph that runs it. Padding rows store into the scratch slot and attend to no
        key (context 0)."""
        n = len(input_ids)
        b = next(size for size in self.sizes if size >= n)
        g = self.inputs
        step = meta.flash if meta.flash is not None else meta.triton
        g["input_ids"][:n] = input_ids
        g["positions"][:n] = positions
        g["slot_mapping"].fill_(self.scratch_slot)
        g["slot_mapping"][:n] = meta.slot_mapping
        g["context_lens"].zero_()
        g["context_lens"][:n] = step.context_lens
        if step.block_tables is not None:
            g["block_tables"][:n, : step.block_tables.shape[1]] = step.block_tables
        return b

    def replay(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:  # pragma: no cover - GPU
        b = self.stage(input_ids, positions, meta)
        self.graphs[b].replay()
        return self.inputs["outputs"][: len(input_ids)]
