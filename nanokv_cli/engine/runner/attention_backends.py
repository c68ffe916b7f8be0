"""Attention back ends: each builds the per-step metadata its layers' path reads.

The model runner lays out one flat batch (single-token rows first, then prompt chunks) and the
plan's back end describes it for attention (``layers/attention.py`` runs it):

- ``PagedC``: every row, decode or prompt, for the CPU's C kernel, which reads K/V in place.
- ``Sdpa``: decodes in length buckets (one gather and one SDPA call each), prompts per chunk.
- ``Flash``: flash-attn's paged kernels on CUDA.
- ``Triton``: every row, decode or prompt, in one launch of our Triton kernel, which reads K/V
  in place (CUDA; CPU tensors under Triton's interpreter).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..layers.attention import (
    AttentionMetadata,
    DecodeGroup,
    FlashMetadata,
    PagedDecode,
    PrefillChunk,
    uses_sdpa_prefill,
)
from ..sequence import Sequence
from .run_plan import RunPlan
from .triton_attention import describe as describe_triton

# Decode queries are split into at most this many length buckets of at least this many
# sequences: a bucket is padded to its own longest context, and each bucket costs one gather
# and one SDPA call per layer. Measured at batch 64 (SmolLM2 shapes, contexts 64..768): one
# bucket pads 45k rows for 28k real ones; eight pad 30k and run ~4x faster per layer.
MAX_DECODE_GROUPS = 8
MIN_DECODE_GROUP = 8

# A prompt chunk of the step: (sequence, its first row in the batch, its context's slots).
Chunk = tuple[Sequence, int, torch.Tensor]


@dataclass
class PagedC:
    """Every row of a CPU step for the C attention kernel, which reads K/V in place.

    A prefill chunk's row i is a query whose context ends at its own position: its K/V (and
    the rest of the chunk's) are stored before attention runs, so the kernel needs no gather of
    a cached prefix and no mask. Against the torch path's blockwise matmuls: 1.2-2x faster for
    128-1024-token prompts (scripts/BENCHMARKS.md, change 18).
    """

    block_size: int
    sorts_decodes = False  # rows attend one by one: no length buckets to keep contiguous

    def describe(
        self,
        meta: AttentionMetadata,
        seqs: list[Sequence],
        contexts: list[int],
        _singles: int,
        _chunks: list[Chunk],
    ) -> None:
        lengths: list[int] = []
        owners: list[int] = []
        for i, (seq, context) in enumerate(zip(seqs, contexts)):
            n = seq.num_scheduled_tokens
            lengths += range(context - n + 1, context + 1)
            owners += [i] * n
        tables = block_tables(seqs, _cdiv(max(contexts), self.block_size), torch.long)
        if len(owners) > len(seqs):
            tables = tables[torch.tensor(owners)]
        meta.paged_decode = PagedDecode(
            block_tables=tables, context_lens=torch.tensor(lengths, dtype=torch.long)
        )


@dataclass
class Sdpa:
    """Decodes in length buckets, prompt chunks per sequence, through torch's SDPA (or
    blockwise matmuls in float32); gathers go through one reusable workspace."""

    block_size: int
    dtype: torch.dtype
    kv_cache_dtype: torch.dtype
    kv_heads: int
    head_dim: int
    device: torch.device
    sorts_decodes = True  # longest contexts first: buckets are contiguous runs of the batch
    _workspace: torch.Tensor | None = field(default=None, repr=False)
    _offsets: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._offsets = torch.arange(self.block_size)  # a block's slots, made once

    def describe(
        self,
        meta: AttentionMetadata,
        seqs: list[Sequence],
        contexts: list[int],
        singles: int,
        chunks: list[Chunk],
    ) -> None:
        meta.decode_groups = self._decode_groups(seqs[:singles], contexts)
        meta.prefills = [self._prefill_chunk(s, first, ctx) for s, first, ctx in chunks]
        meta.workspace = self._gather_workspace(meta)

    def _decode_groups(self, seqs: list[Sequence], contexts: list[int]) -> list[DecodeGroup]:
        if not seqs:
            return []
        offsets = self._offsets
        num_groups = min(MAX_DECODE_GROUPS, max(1, len(seqs) // MIN_DECODE_GROUP))
        bounds = [round(len(seqs) * g / num_groups) for g in range(num_groups + 1)]
        groups = []
        for a, b in zip(bounds, bounds[1:]):
            max_len = contexts[a]  # sorted longest first
            table = block_tables(seqs[a:b], _cdiv(max_len, self.block_size), torch.long)
            slots = (table.unsqueeze(2) * self.block_size + offsets).view(b - a, -1)
            lengths = torch.tensor(contexts[a:b])
            padding = torch.arange(max_len) >= lengths.unsqueeze(1)
            # Padding is masked out, but must still read finite numbers (0 * NaN is NaN): point
            # it at the sequence's first slot, which is always written.
            slots = torch.where(padding, slots[:, :1], slots[:, :max_len])
            bias = torch.zeros(b - a, max_len, dtype=self.dtype).masked_fill_(
                padding, float("-inf")
            )
            groups.append(
                DecodeGroup(
                    start=a, end=b, slots=slots.reshape(-1), bias=bias.view(b - a, 1, 1, max_len)
                )
            )
        return groups

    def _prefill_chunk(self, seq: Sequence, first: int, ctx_slots: torch.Tensor) -> PrefillChunk:
        cached, n = seq.num_cached_tokens, seq.num_scheduled_tokens
        chunk = PrefillChunk(start=first, end=first + n, num_cached=cached)
        if cached:
            chunk.ctx_slots = ctx_slots
        if cached and uses_sdpa_prefill(self.dtype):
            # Query i sits at position cached + i and sees keys 0..cached + i.
            chunk.mask = torch.arange(cached + n).unsqueeze(0) <= (
                torch.arange(cached, cached + n).unsqueeze(1)
            )
        return chunk

    def _gather_workspace(self, meta: AttentionMetadata) -> torch.Tensor | None:
        """The reusable gather buffer, grown to this step's largest gather."""
        rows = max(
            [len(g.slots) for g in meta.decode_groups]
            + [len(c.ctx_slots) for c in meta.prefills if c.ctx_slots is not None],
            default=0,
        )
        if rows == 0:
            return None
        if self._workspace is None or self._workspace.shape[1] < rows:
            grown = max(rows, 2 * self._workspace.shape[1] if self._workspace is not None else 0)
            shape = (2, grown, self.kv_heads, self.head_dim)
            self._workspace = torch.empty(shape, dtype=self.kv_cache_dtype, device=self.device)
        return self._workspace


@dataclass
class Flash:  # pragma: no cover - GPU
    """flash-attn's paged kernels (CUDA, pages of a multiple of 256 tokens)."""

    block_size: int
    sorts_decodes = True

    def describe(
        self,
        meta: AttentionMetadata,
        seqs: list[Sequence],
        contexts: list[int],
        singles: int,
        _chunks: list[Chunk],
    ) -> None:
        q_lens = [s.num_scheduled_tokens for s in seqs]
        width = _cdiv(max(contexts), self.block_size)
        decode_only = singles == len(seqs)
        tables = None
        if decode_only or any(c > q for c, q in zip(contexts, q_lens)):
            tables = block_tables(seqs, width, torch.int32)
        if decode_only:
            meta.flash = FlashMetadata(
                decode_only=True,
                context_lens=torch.tensor(contexts, dtype=torch.int32),
                block_tables=tables,
            )
            return
        meta.flash = FlashMetadata(
            decode_only=False,
            block_tables=tables,
            cu_seqlens_q=_cumsum0(q_lens),
            cu_seqlens_k=_cumsum0(contexts),
            max_seqlen_q=max(q_lens),
            max_seqlen_k=max(contexts),
        )


@dataclass
class Triton:
    """Every row of a step for our Triton kernel (``triton_attention.py``): the sequences in
    the batch's order, each with its rows, context and block table; the kernel reads K/V in
    place, so prompt chunks over a cached prefix need no gather and no mask."""

    block_size: int
    group: int  # query heads per KV head
    kv_heads: int  # this rank's
    sorts_decodes = False  # no length buckets: a program per query tile

    def describe(
        self,
        meta: AttentionMetadata,
        seqs: list[Sequence],
        contexts: list[int],
        _singles: int,
        _chunks: list[Chunk],
    ) -> None:
        tables = block_tables(seqs, _cdiv(max(contexts), self.block_size), torch.int32)
        q_lens = [s.num_scheduled_tokens for s in seqs]
        meta.triton = describe_triton(q_lens, contexts, tables, self.group, self.kv_heads)


Backend = PagedC | Sdpa | Flash | Triton


def backend_for(plan: RunPlan, kv_heads: int, head_dim: int, group: int = 1) -> Backend:
    """The plan's attention back end (``kv_heads``: this rank's; ``group``: query heads per
    KV head)."""
    if plan.attention == "paged-c":
        return PagedC(plan.block_size)
    if plan.attention == "flash":  # pragma: no cover - GPU
        return Flash(plan.block_size)
    if plan.attention == "triton":
        return Triton(plan.block_size, group, kv_heads)
    return Sdpa(plan.block_size, plan.dtype, plan.kv_cache_dtype, kv_heads, head_dim, plan.device)


def block_tables(seqs: list[Sequence], width: int, dtype: torch.dtype) -> torch.Tensor:
    """[len(seqs), width] block tables, cut or padded with block 0 to ``width``."""
    rows = []
    for s in seqs:
        row = s.block_table[:width]
        rows.append(row + [0] * (width - len(row)))
    return torch.tensor(rows, dtype=dtype)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _cumsum0(lengths: list[int]) -> torch.Tensor:  # pragma: no cover - GPU
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
