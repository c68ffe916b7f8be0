"""Paged attention through our own Triton kernel (``triton_kernels.py``): every query row of a
step, decodes and prompt chunks alike, in one launch that reads K/V in place through the block
tables (no gather), on CUDA, or on CPU tensors under Triton's interpreter (tests).

Triton is optional: this module imports it only when a kernel is first launched, so the engine
imports and runs without it; ``available()`` says whether it is installed.

Two launches, chosen by how much work the step's query tiles give a GPU:

- 2D, (query tile, KV head): each program walks all its keys. Enough programs for a GPU as soon
  as the batch holds a few dozen decodes or a prompt chunk.
- 3D, (query tile, KV head, KV split): few query tiles over long contexts (small-batch decode)
  would leave most of the GPU idle, so each program takes one of ``SPLITS`` ranges of the
  keys, and a second kernel merges the partial softmaxes (split-KV, "flash decoding").
"""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass, fields
from functools import cache

import torch

# The 3D launch takes over below this many (query tile, KV head) programs (a GPU has ~100-150
# multiprocessors), for contexts of at least SPLIT_MIN_CONTEXT tokens, in SPLITS ranges.
SPLIT_BELOW_PROGRAMS = 128
SPLIT_MIN_CONTEXT = 1024
SPLITS = 16
MIN_DOT = 16  # tl.dot's least extent on GPUs: score rows, key tiles and head dims pad to it


def available() -> bool:
    """Whether triton is installed (it comes with torch's CUDA wheels on Linux)."""
    return importlib.util.find_spec("triton") is not None


def interpreted() -> bool:
    """Whether Triton runs kernels under its interpreter here (``TRITON_INTERPRET=1``): the
    only way they run on CPU tensors. It must be set before triton is imported, which
    decorates its own library functions then (best: before the process starts)."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes")


@cache
def _kernels():
    from . import triton_kernels  # decorates the kernels: compiled, or interpreted

    return triton_kernels


def query_tile(group: int) -> tuple[int, int]:
    """(score rows, query rows) of a program: the GQA group's heads of ``query rows``
    consecutive queries, at least ``MIN_DOT`` score rows."""
    rows = max(MIN_DOT, _pow2(group))
    return rows, rows // group


@dataclass
class TritonMetadata:
    """One step's rows for the kernel: sequences in the flat batch's order, each with its rows
    ``query_start[i] .. query_start[i + 1]`` and its context after the step."""

    query_start: torch.Tensor  # int32 [seqs + 1]
    context_lens: torch.Tensor  # int32 [seqs]: cached + scheduled tokens
    block_tables: torch.Tensor  # int32 [seqs, width], padded with block 0
    tile_seq: torch.Tensor  # int32 [tiles]: the sequence of each query tile
    tile_first: torch.Tensor  # int32 [tiles]: its first row, counted in the sequence's rows
    num_splits: int = 1  # > 1: the 3D launch

    def to(self, device: torch.device) -> TritonMetadata:
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, value in moved.items():
            if isinstance(value, torch.Tensor):
                moved[name] = value.to(device, non_blocking=True)
        return TritonMetadata(**moved)


def describe(
    q_lens: list[int],
    contexts: list[int],
    block_tables: torch.Tensor,
    group: int,
    kv_heads: int,
    num_splits: int | None = None,
) -> TritonMetadata:
    """The metadata of a step whose sequences compute ``q_lens`` rows each, reaching
    ``contexts`` tokens. ``num_splits``: force a launch (tests, captured graphs); None chooses
    by the work the step gives (``split_kv``)."""
    rows = query_tile(group)[1]
    lens = torch.tensor(q_lens, dtype=torch.int32)
    tiles = (lens + rows - 1) // rows  # each sequence's query tiles, numbered in one run
    total = int(tiles.sum())
    tile_seq = torch.repeat_interleave(torch.arange(len(q_lens), dtype=torch.int32), tiles)
    starts = torch.repeat_interleave(tiles.cumsum(0) - tiles, tiles)
    tile_first = (torch.arange(total) - starts) * rows
    if num_splits is None:
        num_splits = split_kv(total * kv_heads, max(contexts))
    return TritonMetadata(
        query_start=torch.tensor([0, *lens.cumsum(0).tolist()], dtype=torch.int32),
        context_lens=torch.tensor(contexts, dtype=torch.int32),
        block_tables=block_tables.to(torch.int32),
        tile_seq=tile_seq,
        tile_first=tile_first.to(torch.int32),
        num_splits=num_splits,
    )


def split_kv(programs: int, max_context: int) -> int:
    """Key splits per program: ``SPLITS`` when the 2D launch would leave a GPU mostly idle
    over long contexts, else 1."""
    return SPLITS if programs < SPLIT_BELOW_PROGRAMS and max_context >= SPLIT_MIN_CONTEXT else 1


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: TritonMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention of q [rows, heads, head_dim] over the paged cache [blocks, block_size,
    kv_heads, head_dim] (the step's own K/V already stored) -> [rows, heads, head_dim]."""
    if q.stride(-1) != 1:
        q = q.contiguous()
    rows, heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("the K and V caches must share one layout, channels contiguous")
    group = heads // kv_heads
    block_m, block_q = query_tile(group)
    head_dim_p = max(MIN_DOT, _pow2(head_dim))
    out = torch.empty_like(q)
    splits = meta.num_splits
    parts = _partials(rows * heads, splits, head_dim_p, q.device)
    kernels = _kernels()
    kernels.attend[(len(meta.tile_seq), kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        out,
        *parts,
        meta.block_tables,
        meta.query_start,
        meta.context_lens,
        meta.tile_seq,
        meta.tile_first,
        scale * math.log2(math.e),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        *k_cache.stride()[:3],
        meta.block_tables.stride(0),
        heads,
        BLOCK_SIZE=block_size,
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_P=head_dim_p,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        TILE_N=_key_tile(q.dtype, head_dim_p),
        NUM_SPLITS=splits,
        # float32 (tests, --dtype float32) keeps full precision, not TF32's 10-bit mantissa.
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        # Triton's interpreter multiplies bfloat16 tiles wrongly (3.9: as if integers): there
        # the dots take float32 copies; compiled kernels use the tensor cores' bfloat16.
        DOT_FP32=q.dtype == torch.bfloat16 and interpreted(),
    )
    if splits > 1:
        kernels.merge_splits[(rows * heads,)](
            out,
            *parts,
            out.stride(0),
            out.stride(1),
            heads,
            HEAD_DIM=head_dim,
            HEAD_DIM_P=head_dim_p,
            NUM_SPLITS=splits,
        )
    return out


def _partials(
    rows: int, splits: int, head_dim_p: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The 3D launch's partial outputs, maxima and sums (float32); placeholders for 2D."""
    if splits == 1:
        return _placeholders(device)
    n = rows * splits
    return (
        torch.empty(n * head_dim_p, dtype=torch.float32, device=device),
        torch.empty(n, dtype=torch.float32, device=device),
        torch.empty(n, dtype=torch.float32, device=device),
    )


@cache
def _placeholders(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # The 2D launch never touches them: made once per device, not per layer and step.
    return tuple(torch.empty(1, dtype=torch.float32, device=device) for _ in range(3))


def _key_tile(dtype: torch.dtype, head_dim_p: int) -> int:
    # Keys per inner step: 64 in half precision up to head dim 128; float32 and larger heads
    # take 32, so a program's K/V tiles stay within a GPU's registers.
    return 64 if dtype != torch.float32 and head_dim_p <= 128 else 32


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()
