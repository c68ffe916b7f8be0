"""Hits from the second tier (``kv_tier``): a lookup past the device cache's own hits, and an
eviction into the tier. Functions of the BlockManager's books, kept apart as miss_reasons.py
is; the tier's own books are ``engine/tiers/books.py``.

A restored block is one the sequence would otherwise compute: a fresh block from the free
queue, its K/V fetched from the tier now (so a block that cannot be read back is a miss
before anything is counted) and written by the runner before the step's forward pass, then
registered under its hash as if computed. A restored block is no copy source
(``core/copy_sources.py``) until it is computed again: a copy runs before the restores that
fill its source, so a source restored in the same step would lend K/V not yet there.
"""

from __future__ import annotations

from typing import Any

from ..sequence import Sequence
from .events import BlockRestored, BlockStored, TierRemoved, TierStored


def restorable(bm, seq: Sequence, start: int) -> list[Any]:
    """The tier's copies of ``seq``'s full blocks ``start``, ``start + 1``, ... fetched for
    restoring (one handle each): the run the tier holds and the device cache does not, short
    of the block holding the prompt's last token (a step computes at least one). None when
    restoring does not pay (``TierBooks.pays``)."""
    books = bm.tier
    handles: list[Any] = []
    if not books.pays():
        return handles
    for i in range((len(seq) - 1) // bm.block_size)[start:]:
        h = bm._block_hash(seq, i)
        if h not in books or h in bm.hash_to_block_id:
            break
        handle = books.fetch(h, seq.block(i))
        if handle is None:
            if h not in books and bm.on_event:  # it could not be read back: the tier let it go
                bm.on_event(TierRemoved(h, books.medium))
            break
        handles.append(handle)
    return handles


def restore(bm, seq: Sequence, i: int, handle: Any) -> None:
    """Logical block ``i`` of ``seq`` from the tier (``handle``, from ``restorable``)."""
    bm._allocate_free_block(seq)
    block_id = seq.block_table[-1]
    # Placed before registered: a block whose hash resolves must have its K/V on the way.
    bm.tier.place(block_id, handle)
    h, tokens = seq.block_hashes[i], seq.block(i)
    bm.pool.register(bm.blocks[block_id], h, tokens)
    if bm.on_event:
        bm.on_event(BlockStored(block_id, h, seq.block_hashes[i - 1] if i else -1, tokens))
        bm.on_event(BlockRestored(seq.seq_id, block_id, h, bm.tier.medium))


def to_tier(bm, block_id: int, block_hash: int, token_ids) -> None:
    """Evicted block ``block_id``'s content (still in it: nothing overwrote it yet) goes to
    the tier, which may let its least recently used blocks go to make room."""
    books = bm.tier
    dropped = books.store(block_id, block_hash, token_ids)
    if bm.on_event:
        for h in dropped:
            bm.on_event(TierRemoved(h, books.medium))
        if block_hash in books:
            bm.on_event(TierStored(block_hash, books.medium))


def flush(bm) -> int:
    """Store every block the device cache holds and the tier lacks, least recently used first
    (the free queue's order, then blocks in use): the prefixes used most, which the cache
    never evicts, are those a restarted engine should find. How many were stored."""
    books, blocks = bm.tier, bm.blocks
    order = [*bm.free_block_ids, *sorted(bm.used_block_ids)]
    stored = 0
    for block_id in order:
        block = blocks[block_id]
        h = block.hash
        # Registered (computed or restored), once per content (a duplicate's newest copy).
        if h == -1 or bm.hash_to_block_id.get(h) != block_id or h in books:
            continue
        to_tier(bm, block_id, h, block.token_ids)
        stored += 1
    return stored
