"""Attention over the paged KV cache.

Cache layout (one tensor for the whole model, allocated by the model runner)::

    kv_cache[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
             layer     k/v  physical block  offset   head           channel

so layer i's ``k_cache = kv_cache[i, 0]`` is ``[num_blocks, block_size, kv_heads, head_dim]`` -
the paged layout flash-attn reads directly - and viewed as ``[num_blocks * block_size, kv_heads,
head_dim]`` it is indexed by *slot* = ``block_id * block_size + offset``. New K/V rows are written
with one ``index_copy_`` through the step's slot mapping; reads go through block tables.

The batch is flat (``[num_tokens, heads, head_dim]``): the model runner puts the single-token
queries (decodes, and 1-token prefill chunks) first - sorted by context length when they attend
in length buckets - then the multi-token prefill chunks. Two back ends:

* torch (any device, the CPU path): in float32 on CPU, every query row - decodes and each
  row of a prefill chunk alike - attends through a small C kernel that reads K/V in place
  through the block tables (``cpu_kernels.py``). Otherwise decodes attend in a few
  length-bucketed groups, each one gather of the group's cached K/V plus one SDPA call, and
  prefills per sequence, straight from the fresh K/V when nothing is cached, otherwise from
  K/V gathered from the cache, with the causal diagonal offset by the cached prefix
  (blockwise matmuls in float32, SDPA otherwise).
* flash-attn (CUDA, block size a multiple of 256): paged kernels read the cache in place.
* Triton (``triton_attention.py``; CUDA, or CPU under Triton's interpreter): our kernel reads
  the cache in place for every row of the step in one launch.
"""

from dataclasses import dataclass, field
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn

from ..cpu import kernels as cpu_kernels
from ..runner import triton_attention
from ..runner.triton_attention import TritonMetadata

try:  # pragma: no cover - only on CUDA machines with flash-attn installed
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
except ImportError:  # the torch path serves everything flash-attn would
    flash_attn_varlen_func = flash_attn_with_kvcache = None

_TORCH_HAS_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)

# Queries per block of the float32 prefill path (see Attention._prefill_blockwise).
PREFILL_QUERY_BLOCK = 128


def uses_sdpa_prefill(dtype: torch.dtype) -> bool:
    """Whether prefill chunks of this dtype go through SDPA (and so need an explicit mask)."""
    return dtype != torch.float32


@lru_cache(maxsize=16)
def _future_mask(block: int, group: int, device: torch.device) -> torch.Tensor:
    """[block * group, block]: True where key j lies after query i (rows repeat per GQA group)."""
    rows = torch.arange(block, device=device).repeat_interleave(group)
    return torch.arange(block, device=device).unsqueeze(0) > rows.unsqueeze(1)


@dataclass
class DecodeGroup:
    """Single-token queries ``[start, end)`` of the flat batch with similar context lengths.

    Bucketing by length keeps padding small: each group is padded only to its own longest
    context, not the batch's.
    """

    start: int
    end: int
    slots: torch.Tensor  # [n * max_len] slot of each (sequence, position); padding: a valid one
    bias: torch.Tensor  # [n, 1, 1, max_len] additive mask: 0 where valid, -inf on padding


@dataclass
class PagedDecode:
    """Every query row of a CPU step, each attending to the first ``context_lens`` positions of
    its sequence, by the CPU kernel straight from the cache (decodes, and each row of a prefill
    chunk, whose context ends at its own position)."""

    block_tables: torch.Tensor  # int64 [end - start, width], padded with block 0
    context_lens: torch.Tensor  # int64 [end - start]


@dataclass
class PrefillChunk:
    """Queries ``[start, end)`` of one sequence, at positions ``num_cached ..``."""

    start: int
    end: int
    num_cached: int
    ctx_slots: torch.Tensor | None = None  # [num_cached + n] slots of the whole context
    # [n, num_cached + n] bool, causal offset by num_cached; only for the SDPA prefill path
    mask: torch.Tensor | None = None


@dataclass
class FlashMetadata:
    """Arguments of the flash-attn kernels (CUDA only)."""

    decode_only: bool
    context_lens: torch.Tensor | None = None  # int32 [batch] (decode)
    block_tables: torch.Tensor | None = None  # int32 [batch, max_blocks]; None: no cached K/V
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0


@dataclass
class AttentionMetadata:
    """Everything the attention layers need for one step, built once and shared by all layers."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: where each new token's K/V goes
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    paged_decode: PagedDecode | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)
    flash: FlashMetadata | None = None
    triton: TritonMetadata | None = None
    # [2, rows, kv_heads, head_dim], rows >= the largest gather of the step: reused by every
    # group and layer, so gathers neither allocate nor page-fault fresh memory.
    workspace: torch.Tensor | None = None


class Attention(nn.Module):
    """Writes this layer's new K/V into the paged cache, then attends (GQA-aware)."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        # Bound by the model runner to views of its cache; empty during the memory-sizing warm-up.
        self.k_cache = self.v_cache = torch.tensor([])

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q [T, heads, hd], k/v [T, kv_heads, hd] -> [T, heads * hd]."""
        if not self.k_cache.numel():
            pass  # the memory-sizing warm-up runs before the cache exists
        elif cpu_kernels.runs(k):
            cpu_kernels.store_kv(k, v, meta.slot_mapping, self.k_cache, self.v_cache)
        else:
            kvh, hd = self.num_kv_heads, self.head_dim
            self.k_cache.view(-1, kvh, hd).index_copy_(0, meta.slot_mapping, k)
            self.v_cache.view(-1, kvh, hd).index_copy_(0, meta.slot_mapping, v)
        if meta.flash is not None:
            out = self._flash(q, k, v, meta.flash)
        elif meta.triton is not None:
            out = triton_attention.paged_attention(
                q, self.k_cache, self.v_cache, meta.triton, self.scale
            )
        else:
            out = self._torch(q, k, v, meta)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)

    def _torch(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        paged = meta.paged_decode
        if paged is not None:  # the CPU kernels' path serves every row of the step
            out = q.new_empty(q.shape)
            cpu_kernels.paged_decode(
                q,
                self.k_cache,
                self.v_cache,
                paged.block_tables,
                paged.context_lens,
                self.scale,
                out,
            )
            return out
        parts = len(meta.decode_groups) + len(meta.prefills)
        # A step with one part (the common decode step and single prompts) returns its result
        # directly; only mixed steps pay for assembling an output buffer.
        out = None if parts == 1 else q.new_empty(q.shape)
        for group in meta.decode_groups:
            o = self._decode_group(q, group, meta.workspace)
            if out is None:
                return o
            out[group.start : group.end] = o
        for chunk in meta.prefills:
            o = self._prefill_chunk(q, k, v, chunk, meta.workspace)
            if out is None:
                return o
            out[chunk.start : chunk.end] = o
        return out

    def _gather(
        self, slots: torch.Tensor, workspace: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V rows [len(slots), kv_heads, hd] of these cache slots."""
        kvh, hd = self.num_kv_heads, self.head_dim
        k_rows, v_rows = self.k_cache.view(-1, kvh, hd), self.v_cache.view(-1, kvh, hd)
        if workspace is None:
            return k_rows.index_select(0, slots), v_rows.index_select(0, slots)
        n = len(slots)
        return (
            torch.index_select(k_rows, 0, slots, out=workspace[0, :n]),
            torch.index_select(v_rows, 0, slots, out=workspace[1, :n]),
        )

    def _decode_group(
        self, q: torch.Tensor, g: DecodeGroup, workspace: torch.Tensor | None
    ) -> torch.Tensor:
        n = g.end - g.start
        kvh, hd = self.num_kv_heads, self.head_dim
        max_len = g.bias.shape[-1]
        # Gathering the group's K/V costs one copy; SDPA then reads it with the padding masked.
        # (Measured on CPU: a fused gather+attention kernel from torch.compile was no faster, and
        # SDPA beat baddbmm/softmax/bmm on per-head contiguous copies.) The query heads sharing
        # a KV head are folded into SDPA's query-length axis ([n, kv_heads, group, hd] against
        # [n, kv_heads, len, hd]): GQA with no repeated K/V.
        key, value = self._gather(g.slots, workspace)
        key, value = key.view(n, max_len, kvh, hd), value.view(n, max_len, kvh, hd)
        query = q[g.start : g.end].view(n, kvh, self.group, hd)
        o = F.scaled_dot_product_attention(
            query, key.transpose(1, 2), value.transpose(1, 2), attn_mask=g.bias, scale=self.scale
        )
        # reshape, not view: SDPA's output need not be contiguous (CUDA's float32 kernel lays
        # it out heads-first), and a view of it fails on every decode step (issue 44).
        return o.reshape(n, self.num_heads, hd)

    def _prefill_chunk(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        c: PrefillChunk,
        workspace: torch.Tensor | None,
    ) -> torch.Tensor:
        if c.ctx_slots is None:
            # Nothing cached before this chunk: its own K/V is the whole context.
            key, value = k[c.start : c.end], v[c.start : c.end]
        else:
            key, value = self._gather(c.ctx_slots, workspace)
        if not uses_sdpa_prefill(q.dtype):
            return self._prefill_blockwise(q[c.start : c.end], key, value, c.num_cached)
        query = q[c.start : c.end].transpose(0, 1)  # [heads, n, hd]
        # SDPA's is_causal aligns top-left; with a cached prefix the diagonal is offset.
        mask, causal = (None, True) if c.ctx_slots is None else (c.mask, False)
        key, value = key.transpose(0, 1), value.transpose(0, 1)
        if _TORCH_HAS_GQA:
            o = F.scaled_dot_product_attention(
                query,
                key,
                value,
                attn_mask=mask,
                is_causal=causal,
                scale=self.scale,
                enable_gqa=True,
            )
        else:  # pragma: no cover - torch < 2.5
            key = key.repeat_interleave(self.group, 0)
            value = value.repeat_interleave(self.group, 0)
            o = F.scaled_dot_product_attention(
                query, key, value, attn_mask=mask, is_causal=causal, scale=self.scale
            )
        return o.transpose(0, 1)

    def _prefill_blockwise(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_cached: int
    ) -> torch.Tensor:
        """Causal attention of q [n, heads, hd] (positions num_cached..) over k/v [L, kv_heads, hd].

        Plain matmul/softmax/matmul over blocks of queries, each against only the keys up to its
        last position. In float32 on CPU this runs ~2x faster than SDPA's flash kernel (measured:
        1024-token prompt, 70 -> 33 ms per layer) because the two matmuls are large GEMMs;
        blocks keep the score matrix small, and the GQA group is folded into the query rows.
        Reduced precision keeps SDPA, which accumulates the softmax in float32.
        """
        n, kvh, group, hd = q.shape[0], self.num_kv_heads, self.group, self.head_dim
        keys = k.permute(1, 2, 0)  # [kv_heads, hd, L]: a transposed view BLAS reads in place
        values = v.transpose(0, 1)  # [kv_heads, L, hd]
        out = q.new_empty(n, self.num_heads, hd)
        for start in range(0, n, PREFILL_QUERY_BLOCK):
            end = min(n, start + PREFILL_QUERY_BLOCK)
            m, seen = end - start, num_cached + end  # queries in the block, keys they may see
            query = q[start:end].view(m, kvh, group, hd).transpose(0, 1).reshape(kvh, m * group, hd)
            scores = torch.matmul(query, keys[:, :, :seen]).mul_(self.scale)
            # Keys before the block are visible to all its queries; only the last m need a mask.
            scores[:, :, num_cached + start :].masked_fill_(
                _future_mask(m, group, q.device), float("-inf")
            )
            o = torch.matmul(scores.softmax(-1), values[:, :seen])  # [kv_heads, m * group, hd]
            out[start:end] = o.view(kvh, m, group, hd).transpose(0, 1).reshape(m, -1, hd)
        return out

    def _flash(  # pragma: no cover - needs CUDA and flash-attn
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: FlashMetadata
    ) -> torch.Tensor:
        if f.decode_only:
            return flash_attn_with_kvcache(
                q.unsqueeze(1),
                self.k_cache,
                self.v_cache,
                cache_seqlens=f.context_lens,
                block_table=f.block_tables,
                softmax_scale=self.scale,
                causal=True,
            )
        if f.block_tables is not None:  # some context lives only in the cache: read it paged
            k, v = self.k_cache, self.v_cache
        return flash_attn_varlen_func(
            q,
            k,
            v,
            cu_seqlens_q=f.cu_seqlens_q,
            cu_seqlens_k=f.cu_seqlens_k,
            max_seqlen_q=f.max_seqlen_q,
            max_seqlen_k=f.max_seqlen_k,
            softmax_scale=self.scale,
            causal=True,
            block_table=f.block_tables,
        )
