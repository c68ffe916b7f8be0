"""The books of the paged KV cache: which physical block holds what, and who uses it.

Blocks are never moved or copied; a sequence's ``block_table`` maps its logical blocks to
physical ones. Full blocks whose KV has been computed are registered in the prefix cache under
a chained hash (the hash of a block stands for the whole prefix up to and including it), so a
later request with the same prefix maps the same physical blocks instead of recomputing them.
"""

from __future__ import annotations

import sys
from array import array
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import xxhash

from .events import (
    AllBlocksCleared,
    BlockAllocated,
    BlockFreed,
    BlockHit,
    BlockRemoved,
    BlockStored,
    EventListener,
)
from .sequence import Sequence

_LITTLE_ENDIAN = sys.byteorder == "little"


def _same_tokens(a, b) -> bool:
    if type(a) is type(b):
        return a == b
    return list(a) == list(b)  # a list and an int64 array: rare, compare element-wise


class Block:
    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1
        self.token_ids: list[int] = []

    def update(self, hash: int, token_ids: list[int]) -> None:
        self.hash = hash
        self.token_ids = token_ids

    def reset(self) -> None:
        self.ref_count = 1
        self.hash = -1
        self.token_ids = []

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref_count={self.ref_count}, hash={self.hash})"


class FreeBlockQueue:
    """FIFO of free block ids with O(1) removal from the middle.

    A prefix-cache hit on a free block ("revival") must take it out wherever it sits; nano-vllm's
    ``deque.remove`` makes that O(n). An OrderedDict is a C-level doubly linked list keyed by id.
    """

    def __init__(self, block_ids: range | list[int]) -> None:
        self._queue: OrderedDict[int, None] = OrderedDict.fromkeys(block_ids)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[int]:
        return iter(self._queue)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._queue

    def __repr__(self) -> str:
        return f"FreeBlockQueue({list(self._queue)})"

    def popleft(self) -> int:
        return self._queue.popitem(last=False)[0]

    def append(self, block_id: int) -> None:
        self._queue[block_id] = None

    def remove(self, block_id: int) -> None:
        del self._queue[block_id]


@dataclass
class CacheStats:
    """Prefix-cache statistics, counted in tokens like vLLM (blocks x block_size)."""

    queries: int = 0  # prompt tokens looked up at admission
    shared_hits: int = 0  # tokens served by blocks other sequences were using
    revived_hits: int = 0  # tokens served by free blocks that still held their hash
    evictions: int = 0  # hashed blocks reused for new data (their mapping deleted)
    preemptions: int = 0

    @property
    def hits(self) -> int:
        return self.shared_hits + self.revived_hits

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        on_event: EventListener | None = None,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids = FreeBlockQueue(range(num_blocks))
        self.used_block_ids: set[int] = set()
        self.hash_to_block_id: dict[int, int] = {}
        self.stats = CacheStats()
        self.num_cached_free_blocks = 0  # free blocks still holding a hash (reusable until evicted)
        # Called with every event; None (or an empty EventBus) costs one truth test per change.
        self.on_event = on_event

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @classmethod
    def compute_hash(cls, token_ids: list[int], prefix: int = -1) -> int:
        h = xxhash.xxh64()
        if prefix != -1:
            h.update(prefix.to_bytes(8, "little"))
        if isinstance(token_ids, array) and token_ids.typecode == "q" and _LITTLE_ENDIAN:
            h.update(token_ids)  # already little-endian int64 bytes: no conversion
        else:
            h.update(np.asarray(token_ids, dtype="<i8").tobytes())
        return h.intdigest()

    def _block_hash(self, seq: Sequence, i: int) -> int:
        """Chained hash of full block ``i`` of ``seq``, memoized on the sequence."""
        hashes = seq.block_hashes
        while len(hashes) <= i:
            j = len(hashes)
            hashes.append(self.compute_hash(seq.block(j), hashes[j - 1] if j else -1))
        return hashes[i]

    def _lookup(self, seq: Sequence, i: int) -> int:
        """Physical block holding logical block ``i`` of ``seq`` in the prefix cache, or -1."""
        block_id = self.hash_to_block_id.get(self._block_hash(seq, i), -1)
        # A hash match alone is not proof: verify the tokens (xxh64 can collide).
        if block_id != -1 and not _same_tokens(self.blocks[block_id].token_ids, seq.block(i)):
            return -1
        return block_id

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Physical blocks of the longest cached prefix of ``seq``'s full blocks.

        The block holding the last token never counts: a step must compute at least one token
        to produce logits, so a fully cached prompt still prefills its final block.
        """
        if not self.enable_prefix_caching:
            return []
        hit_ids = []
        for i in range((len(seq) - 1) // self.block_size):
            block_id = self._lookup(seq, i)
            if block_id == -1:
                break
            hit_ids.append(block_id)
        return hit_ids

    def can_allocate(self, seq: Sequence) -> int:
        hit_ids = self._cached_prefix(seq)
        revived = sum(1 for b in hit_ids if self.blocks[b].ref_count == 0)
        needed = seq.num_blocks - len(hit_ids) + revived
        return len(hit_ids) if needed <= len(self.free_block_ids) else -1

    def allocate(self, seq: Sequence, num_cached_blocks: int) -> None:
        assert not seq.block_table, f"sequence {seq.seq_id} already holds blocks"
        emit = self.on_event
        for i in range(num_cached_blocks):
            block_id = self._lookup(seq, i)
            assert block_id != -1, (
                "allocate() was given more cached blocks than can_allocate() found"
            )
            block = self.blocks[block_id]
            if block.ref_count:
                block.ref_count += 1
                kind = "shared"
                self.stats.shared_hits += self.block_size
            else:
                self.free_block_ids.remove(block_id)
                self.num_cached_free_blocks -= 1
                self.used_block_ids.add(block_id)
                block.ref_count = 1
                kind = "revived"
                self.stats.revived_hits += self.block_size
            seq.block_table.append(block_id)
            if emit:
                emit(BlockHit(seq.seq_id, block_id, block.hash, kind))
        for _ in range(num_cached_blocks, seq.num_blocks):
            self._allocate_free_block(seq)
        if self.enable_prefix_caching:
            self.stats.queries += seq.num_tokens
        seq.num_cached_tokens = num_cached_blocks * self.block_size

    def _allocate_free_block(self, seq: Sequence) -> None:
        block_id = self.free_block_ids.popleft()
        block = self.blocks[block_id]
        if block.hash != -1:
            # Eviction: the LRU cached block is overwritten, so its hash must stop resolving.
            if self.hash_to_block_id.get(block.hash) == block_id:
                del self.hash_to_block_id[block.hash]
            self.stats.evictions += 1
            self.num_cached_free_blocks -= 1
            if self.on_event:
                self.on_event(BlockRemoved(block_id, block.hash))
        block.reset()
        self.used_block_ids.add(block_id)
        seq.block_table.append(block_id)
        if self.on_event:
            self.on_event(BlockAllocated(seq.seq_id, block_id))

    def deallocate(self, seq: Sequence) -> None:
        emit = self.on_event
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                # To the tail, hash kept: reusable until it reaches the head. Walking the table
                # backwards queues a sequence's tail blocks ahead of its prefix, so the prefix
                # (the part other requests share) is evicted last.
                self.used_block_ids.discard(block_id)
                self.free_block_ids.append(block_id)
                self.num_cached_free_blocks += block.hash != -1
            if emit:
                emit(BlockFreed(seq.seq_id, block_id, block.ref_count))
        seq.block_table.clear()
        seq.num_cached_tokens = 0

    def can_append(self, seq: Sequence) -> bool:
        # A decode step needs a new block only when the token to compute opens one:
        # len(seq) % block_size == 1, written so that block_size 1 works too.
        return len(self.free_block_ids) >= ((seq.num_tokens - 1) % self.block_size == 0)

    def may_append(self, seq: Sequence) -> None:
        # The token about to be computed is the last one; it needs a new block when it opens one.
        if len(seq.block_table) * self.block_size < seq.num_tokens:
            self._allocate_free_block(seq)

    def hash_blocks(self, seq: Sequence) -> None:
        """Register the blocks that became full in the step that just computed
        ``seq.num_scheduled_tokens`` tokens from ``seq.num_cached_tokens`` on."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        start = seq.num_cached_tokens // bs
        end = (seq.num_cached_tokens + seq.num_scheduled_tokens) // bs
        for i in range(start, end):
            block = self.blocks[seq.block_table[i]]
            if block.hash != -1:
                continue  # a prefix hit, registered by whoever computed it
            h = self._block_hash(seq, i)
            token_ids = seq.block(i)
            block.update(h, token_ids)
            # Two sequences that computed the same new block in one step each hold a copy; the
            # later registration wins, and either copy is a valid target for the hash.
            self.hash_to_block_id[h] = block.block_id
            if self.on_event:
                self.on_event(
                    BlockStored(block.block_id, h, seq.block_hashes[i - 1] if i else -1, token_ids)
                )

    def reset_prefix_cache(self) -> None:
        """Forget every registered hash (e.g. after weights change)."""
        for block in self.blocks:
            block.hash = -1
            block.token_ids = []
        self.hash_to_block_id.clear()
        self.num_cached_free_blocks = 0
        if self.on_event:
            self.on_event(AllBlocksCleared())

    def check_invariants(self, live_seqs: list[Sequence] | None = None) -> None:
        """Assert the books balance. With ``live_seqs``, ref counts must equal table membership."""
        n = len(self.blocks)
        free = list(self.free_block_ids)
        assert len(free) == len(set(free)), "duplicate ids in the free queue"
        assert set(free).isdisjoint(self.used_block_ids), "a block is both free and used"
        assert len(free) + len(self.used_block_ids) == n, "free and used do not cover all blocks"
        for block in self.blocks:
            assert (block.ref_count > 0) == (block.block_id in self.used_block_ids), block
            assert block.ref_count >= 0, block
        cached_free = sum(1 for b in free if self.blocks[b].hash != -1)
        assert cached_free == self.num_cached_free_blocks, "cached-free counter drifted"
        for h, b in self.hash_to_block_id.items():
            assert self.blocks[b].hash == h, (
                f"hash {h} maps to block {b} holding {self.blocks[b].hash}"
            )
        if live_seqs is not None:
            counts = [0] * n
            for seq in live_seqs:
                assert len(seq.block_table) == len(set(seq.block_table)), seq
                for b in seq.block_table:
                    counts[b] += 1
            for block in self.blocks:
                assert block.ref_count == counts[block.block_id], (
                    f"block {block.block_id}: ref_count {block.ref_count} != {counts[block.block_id]} tables"
                )
