"""The books of the paged KV cache: which physical block holds what, and who uses it.

Blocks are never moved or copied; a sequence's ``block_table`` maps its logical blocks to
physical ones. Full blocks whose KV has been computed are registered in the prefix cache under
a chained hash (the hash of a block stands for the whole prefix up to and including it), so a
later request with the same prefix maps the same physical blocks instead of recomputing them.

Each change does whatever may raise before it touches the books, and announces itself (one
event) only once they balance. So an exception at any call, KeyboardInterrupt included, leaves
balanced books and an event stream that matches them; what it may leave half done is a
sequence's set of blocks, which the scheduler's ``recover`` completes or undoes.
"""

from __future__ import annotations

import sys
from array import array
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import xxhash

from .events import (
    AllBlocksCleared,
    BlockAllocated,
    BlockFreed,
    BlockHit,
    BlockRemoved,
    BlockStored,
    CacheLookup,
    EventListener,
)
from .miss_reasons import MissExplainer
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

    def head(self) -> int:
        return next(iter(self._queue))

    def popleft(self) -> int:
        return self._queue.popitem(last=False)[0]

    def append(self, block_id: int) -> None:
        self._queue[block_id] = None

    def remove(self, block_id: int) -> None:
        del self._queue[block_id]


# Why a prompt lookup missed, in the order the reasons are tested (the first that applies).
MISS_REASONS = ("disabled", "preempted", "last-block", "in-flight", "evicted", "partial", "cold")


@dataclass
class CacheStats:
    """Prefix-cache statistics, counted in tokens like vLLM (blocks x block_size).

    ``queries``/``hits`` count each request's *first* admission only: that is the hit rate
    everywhere nanokv prints one (vLLM's ``prefix_cache_hits / prefix_cache_queries``). A
    sequence preempted and admitted again looks its tokens up again; those lookups go to the
    ``readmission_*`` counters, so recomputation never inflates the headline.
    ``miss_tokens`` splits every missed token, first admissions and re-admissions alike, by
    reason (``MISS_REASONS``): ``sum(miss_tokens.values()) == misses + readmission_misses``.
    """

    queries: int = 0  # prompt tokens looked up at first admission
    shared_hits: int = 0  # ...served by blocks other sequences were using
    revived_hits: int = 0  # ...served by free blocks that still held their hash
    readmission_queries: int = 0  # tokens looked up again after a preemption
    readmission_shared_hits: int = 0
    readmission_revived_hits: int = 0
    evictions: int = 0  # cached blocks reused for new data (their hash left the cache)
    preemptions: int = 0
    miss_tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MISS_REASONS, 0))

    @property
    def hits(self) -> int:
        return self.shared_hits + self.revived_hits

    @property
    def readmission_hits(self) -> int:
        return self.readmission_shared_hits + self.readmission_revived_hits

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
        # The engine's step number, for the record of when a hash was evicted.
        self.step = 0
        self._explainer = MissExplainer(block_size, num_blocks)

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

    def is_in_flight(self, seq: Sequence, num_cached_blocks: int) -> bool:
        """Whether the first block of ``seq`` past its cached prefix is being computed by
        another sequence right now, so that waiting a step or two turns it into a hit."""
        i = num_cached_blocks
        if i >= (len(seq) - 1) // self.block_size or not self.enable_prefix_caching:
            return False
        return self._explainer.is_pending(self._block_hash(seq, i))

    def allocate(self, seq: Sequence, num_cached_blocks: int) -> None:
        """Admit ``seq``: its first ``num_cached_blocks`` blocks from the prefix cache (as
        ``can_allocate`` found them), fresh blocks for the rest.

        The lookup is counted (stats, ``CacheLookup``) before any block is taken, and each
        block's books balance before its event goes out. Cut short by an exception, ``seq``
        holds part of its blocks after a counted admission: the scheduler's ``recover`` then
        preempts it, as if the cache had run out right after admitting it."""
        assert not seq.block_table, f"sequence {seq.seq_id} already holds blocks"
        bs = self.block_size
        first = seq.num_prefix_hit_tokens < 0
        reason, evicted_at, partial = self._explainer.explain(self, seq, num_cached_blocks, first)
        hit_ids = [self._lookup(seq, i) for i in range(num_cached_blocks)]
        assert -1 not in hit_ids, (
            "allocate() was given more cached blocks than can_allocate() found"
        )
        shared = bs * sum(1 for b in hit_ids if self.blocks[b].ref_count)
        revived = bs * num_cached_blocks - shared
        self._count_lookup(seq, first, shared, revived, reason)
        seq.num_cached_tokens = num_cached_blocks * bs
        if self.on_event:
            self.on_event(
                CacheLookup(
                    seq.seq_id,
                    seq.num_tokens,
                    num_cached_blocks * bs,
                    first,
                    reason,
                    num_cached_blocks,
                    evicted_at,
                    partial,
                )
            )
        blocks, table, emit = self.blocks, seq.block_table, self.on_event
        for block_id in hit_ids:
            block = blocks[block_id]
            if block.ref_count:
                block.ref_count += 1
                kind = "shared"
            else:
                self.free_block_ids.remove(block_id)  # first: if it raises, nothing has changed
                self.num_cached_free_blocks -= 1
                self.used_block_ids.add(block_id)
                block.ref_count = 1
                kind = "revived"
            table.append(block_id)
            if emit:
                emit(BlockHit(seq.seq_id, block_id, block.hash, kind))
        for _ in range(num_cached_blocks, seq.num_blocks):
            self._allocate_free_block(seq)
        if self.enable_prefix_caching:
            self._explainer.admitted(self, seq, num_cached_blocks)

    def _count_lookup(
        self, seq: Sequence, first: bool, shared: int, revived: int, reason: str
    ) -> None:
        stats = self.stats
        if first:
            stats.queries += seq.num_tokens
            stats.shared_hits += shared
            stats.revived_hits += revived
            seq.num_prefix_hit_tokens = shared + revived
        else:
            stats.readmission_queries += seq.num_tokens
            stats.readmission_shared_hits += shared
            stats.readmission_revived_hits += revived
        stats.miss_tokens[reason] += seq.num_tokens - shared - revived

    def _allocate_free_block(self, seq: Sequence) -> None:
        free = self.free_block_ids
        if self.num_cached_free_blocks:  # the head may hold a hash
            head = self.blocks[free.head()]
            if head.hash != -1:
                self._evict(head)
        block_id = free.popleft()  # first: if it raises, nothing has changed
        block = self.blocks[block_id]
        block.reset()
        self.used_block_ids.add(block_id)
        seq.block_table.append(block_id)
        if self.on_event:
            self.on_event(BlockAllocated(seq.seq_id, block_id))

    def _evict(self, block: Block) -> None:
        """The LRU cached block is about to be overwritten, so its hash stops resolving. (Every
        hashed free block resolves: duplicates are never registered, see hash_blocks.) A change
        of its own, announced before the block is taken: one event per change, so a listener
        that raises cannot leave another listener with half of one."""
        h = block.hash
        del self.hash_to_block_id[h]
        block.hash = -1
        block.token_ids = []
        self.stats.evictions += 1
        self.num_cached_free_blocks -= 1
        self._explainer.evicted(h, self.step)
        if self.on_event:
            self.on_event(BlockRemoved(block.block_id, h))

    def deallocate(self, seq: Sequence) -> None:
        """Let go of ``seq``'s blocks, last first. Each block leaves the table once its books
        balance, so a release cut short by an exception leaves exactly the blocks still held
        in the table, and calling again finishes it."""
        emit = self.on_event
        if self.enable_prefix_caching:
            self._explainer.released(seq)
        table, blocks, free = seq.block_table, self.blocks, self.free_block_ids
        while table:
            block_id = table[-1]
            block = blocks[block_id]
            if block.ref_count == 1:
                # To the tail, hash kept: reusable until it reaches the head. Walking the table
                # backwards queues a sequence's tail blocks ahead of its prefix, so the prefix
                # (the part other requests share) is evicted last.
                free.append(block_id)  # first: if it raises, nothing has changed
                self.used_block_ids.discard(block_id)
                self.num_cached_free_blocks += block.hash != -1
            block.ref_count -= 1
            table.pop()
            if emit:
                emit(BlockFreed(seq.seq_id, block_id, block.ref_count))
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
        explainer = self._explainer
        for i in range(start, end):
            block = self.blocks[seq.block_table[i]]
            if block.hash != -1:
                continue  # a prefix hit, registered by whoever computed it
            h = self._block_hash(seq, i)
            if h in self.hash_to_block_id:
                # A duplicate: this content is cached in another block already (a prompt's
                # always-computed last block, or an answer another sequence also generated).
                # The first copy keeps serving the hash; this one stays unregistered, so every
                # hashed block resolves and an eviction always means the content is gone.
                continue
            token_ids = seq.block(i)
            parent = seq.block_hashes[i - 1] if i else -1
            # The explainer's hint first: the books change after every call that may raise
            # (a hint about a hash never registered is looked up and found missing).
            explainer.stored(h, parent, token_ids[0])
            block.update(h, token_ids)
            self.hash_to_block_id[h] = block.block_id
            if self.on_event:
                self.on_event(BlockStored(block.block_id, h, parent, token_ids))
        explainer.progressed(self, seq, start, end)

    def reclaim(self, prefilling: list[Sequence]) -> None:
        """Rebuild the claims on blocks being computed from the sequences mid-prefill (after
        an exception cut a step short, the claims may name sequences that no longer compute)."""
        if self.enable_prefix_caching:
            self._explainer.reclaim(self, prefilling)

    def reset_prefix_cache(self) -> None:
        """Forget every registered hash (e.g. after weights change)."""
        for block in self.blocks:
            block.hash = -1
            block.token_ids = []
        self.hash_to_block_id.clear()
        self.num_cached_free_blocks = 0
        self._explainer.cleared()
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
        hashed = sum(1 for b in self.blocks if b.hash != -1)
        assert hashed == len(self.hash_to_block_id), "a hashed block the prefix cache cannot reach"
        s = self.stats
        assert s.hits <= s.queries and s.readmission_hits <= s.readmission_queries, s
        misses = s.queries - s.hits + s.readmission_queries - s.readmission_hits
        assert sum(s.miss_tokens.values()) == misses, "miss reasons do not sum to the misses"
        if self.enable_prefix_caching:
            assert s.miss_tokens["preempted"] == s.readmission_queries - s.readmission_hits, s
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
            # A claim nobody will honour holds its followers back for good.
            for b in self._explainer.claimed_blocks():
                assert counts[b], f"block {b} is claimed as being computed but no table holds it"
