"""The Triton kernels of paged attention (launched by ``triton_attention.py``, which imports
this module on first use only: triton is optional, and whether a kernel is compiled or runs
under Triton's interpreter, ``TRITON_INTERPRET=1``, is decided when it is decorated here).

``attend``: one program per (query tile, KV head, KV split). A query tile is up to
``BLOCK_Q`` consecutive query rows of one sequence, times the ``GROUP`` query heads sharing
the KV head: ``BLOCK_M`` rows of the score matrix, so GQA/MQA read each K/V tile once for the
whole group, and a decode row (one query) still fills the tensor cores' 16 rows with heads.
Keys are walked in tiles of ``TILE_N`` positions; each position's physical block is looked up
in the sequence's block table, so any block size works and K/V are read in place. Row i of a
sequence with ``n`` rows this step and context ``c`` sits at position ``c - n + i`` and sees
keys ``0 .. c - n + i``: a decode, a prompt chunk over a cached prefix and a whole prompt are
the same case. The softmax is online (running max and sum, in log2 units).

With ``NUM_SPLITS`` > 1 (the 3D launch, for few long sequences) each program covers one of
``NUM_SPLITS`` ranges of the key tiles and writes its unnormalised partial output, max and sum;
``merge_splits`` combines them.
"""

import triton
import triton.language as tl


@triton.jit
def attend(
    q, k_cache, v_cache, out, part_acc, part_max, part_sum,
    block_tables, query_start, context_lens, tile_seq, tile_first, scale_log2,
    stride_q_row, stride_q_head, stride_o_row, stride_o_head,
    stride_k_block, stride_k_slot, stride_k_head, stride_table, num_heads,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
):  # fmt: skip
    """One (query tile, KV head, split) program. K and V caches share their strides."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(tile_seq + tile)
    first = tl.load(tile_first + tile)
    row0 = tl.load(query_start + seq)
    q_len = tl.load(query_start + seq + 1) - row0
    prefix = tl.load(context_lens + seq) - q_len  # positions before this step's rows

    rows = tl.arange(0, BLOCK_M)
    q_idx = first + rows // GROUP  # the query row within the sequence's rows
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows // GROUP < BLOCK_Q) & (q_idx < q_len)
    dims = tl.arange(0, HEAD_DIM_P)
    batch_row = (row0 + q_idx).to(tl.int64)
    q_tile = tl.load(
        q + batch_row[:, None] * stride_q_row + head[:, None] * stride_q_head + dims[None, :],
        mask=row_ok[:, None] & (dims < HEAD_DIM)[None, :],
        other=0.0,
    )
    if DOT_FP32:
        q_tile = q_tile.to(tl.float32)

    # Keys up to the tile's last row's position; this split's share of their tiles.
    keys_end = prefix + tl.minimum(first + BLOCK_Q, q_len)
    num_tiles = tl.cdiv(keys_end, TILE_N)
    per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    lo = split * per_split
    hi = tl.minimum(num_tiles, lo + per_split)
    table = block_tables + seq.to(tl.int64) * stride_table
    kv_offset = kv_head * stride_k_head
    acc, m_i, l_i = _walk_keys(
        q_tile, prefix + q_idx, k_cache + kv_offset, v_cache + kv_offset, table,
        stride_k_block, stride_k_slot,
        keys_end, lo, hi, scale_log2, BLOCK_SIZE, HEAD_DIM, HEAD_DIM_P, BLOCK_M, TILE_N,
        PRECISION, DOT_FP32,
    )  # fmt: skip

    if NUM_SPLITS == 1:
        result = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out + batch_row[:, None] * stride_o_row + head[:, None] * stride_o_head + dims[None, :],
            result.to(out.dtype.element_ty),
            mask=row_ok[:, None] & (dims < HEAD_DIM)[None, :],
        )
    else:
        part = (batch_row * num_heads + head) * NUM_SPLITS + split
        tl.store(part_acc + part[:, None] * HEAD_DIM_P + dims[None, :], acc, mask=row_ok[:, None])
        tl.store(part_max + part, m_i, mask=row_ok)
        tl.store(part_sum + part, l_i, mask=row_ok)


@triton.jit
def _walk_keys(
    q_tile, q_pos, k_cache, v_cache, table, stride_block, stride_slot, keys_end, lo, hi,
    scale_log2,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
    BLOCK_M: tl.constexpr, TILE_N: tl.constexpr, PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
):  # fmt: skip
    """Key tiles ``lo .. hi`` of one KV head (``k_cache``/``v_cache`` point at it) for the
    rows at positions ``q_pos``: (unnormalised output, running max, running sum)."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)
    dims = tl.arange(0, HEAD_DIM_P)
    for t in range(lo, hi):
        pos = t * TILE_N + tl.arange(0, TILE_N)
        pos_ok = pos < keys_end
        block = tl.load(table + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        slot = block * stride_block + (pos % BLOCK_SIZE) * stride_slot
        ok = pos_ok[:, None] & (dims < HEAD_DIM)[None, :]
        k_tile = tl.load(k_cache + slot[:, None] + dims[None, :], mask=ok, other=0.0)
        v_tile = tl.load(v_cache + slot[:, None] + dims[None, :], mask=ok, other=0.0)
        if DOT_FP32:
            k_tile, v_tile = k_tile.to(tl.float32), v_tile.to(tl.float32)
        s = tl.dot(q_tile, tl.trans(k_tile), input_precision=PRECISION) * scale_log2
        s = tl.where((pos[None, :] <= q_pos[:, None]) & pos_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no key yet (padding, or an empty split) keeps -inf: subtract 0.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v_tile.dtype), v_tile, input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def merge_splits(
    out,
    part_acc,
    part_max,
    part_sum,
    stride_o_row,
    stride_o_head,
    num_heads,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    """One program per (row, head): the splits' partial outputs, rescaled to a common max."""
    index = tl.program_id(0).to(tl.int64)
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, HEAD_DIM_P)
    m = tl.load(part_max + index * NUM_SPLITS + splits)
    l_split = tl.load(part_sum + index * NUM_SPLITS + splits)
    m_max = tl.max(m, 0)
    weight = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # empty split: 0
    total = tl.sum(l_split * weight, 0)
    acc = tl.load(part_acc + (index * NUM_SPLITS + splits)[:, None] * HEAD_DIM_P + dims[None, :])
    result = tl.sum(acc * weight[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    row, head = index // num_heads, index % num_heads
    tl.store(
        out + row * stride_o_row + head * stride_o_head + dims,
        result.to(out.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )
