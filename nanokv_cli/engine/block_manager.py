"""The books of the paged KV cache: which physical block holds what, and who uses it.

A sequence's ``block_table`` maps its logical blocks to physical ones. Full blocks whose KV has
been computed are registered in the prefix cache under a chained hash (the hash of a block
stands for the whole prefix up to and including it), so a later request with the same prefix
maps the same physical blocks instead of recomputing them.

Reuse is token-granular by default (``prefix_match="token"``): after the last full-block hit,
a block that continues the same prefix (one whose content follows the same parent hash and
starts with the same token: a registered block, a running sequence's last block, or the last
block a finished one left in the free queue) lends the longest run of leading tokens it shares
with the prompt's next block. Their K/V are copied into the fresh block the sequence gets
(``Sequence.kv_copy``; the runner copies before the step's forward pass). The newest few such
blocks are kept per prefix (``CONTINUATIONS_KEPT``), and the one with the most computed tokens
in common lends them: the newest is often a sequence still running that parts from the prompt
early, while a finished one in the free queue holds all of it. Causal attention makes those
K/V the ones the sequence would compute. ``prefix_match="block"`` is the seed's whole-block
reuse, exactly.

The books themselves are the pool's (``core/block_pool.py``: ref counts, the free queue, the
hash map) and the copy sources' (``core/copy_sources.py``); this class decides, per sequence,
what to take and free, explains misses, and counts. Each change does whatever may raise before
it touches the books, and announces itself (one event) only once they balance. So an exception
at any call, KeyboardInterrupt included, leaves balanced books and an event stream that matches
them; what it may leave half done is a sequence's set of blocks, which the scheduler's
``recover`` completes or undoes.
"""

from __future__ import annotations

from .config import PREFIX_MATCH_MODES
from .core import tier_hits
from .core.block_pool import BlockPool
from .core.blocks import Block, common_prefix, hash_block_tokens
from .core.cache_stats import CacheStats
from .core.copy_sources import CopySources
from .core.events import (
    AllBlocksCleared,
    BlockAllocated,
    BlockCopied,
    BlockFreed,
    BlockHit,
    BlockRemoved,
    BlockStored,
    CacheLookup,
    EventListener,
)
from .core.miss_reasons import MissExplainer
from .sequence import Sequence
from .tiers.books import TierBooks

# Block is re-exported: the seed's public path (it lives in core/blocks.py).
__all__ = ["MIN_WAIT_TOKENS", "Block", "BlockManager"]


# A follower waits a step for a prompt block another sequence is filling only when it would
# copy at least this many tokens more by waiting: a few tokens cost less to compute than a
# step's delay to the follower's first token.
MIN_WAIT_TOKENS = 16


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        on_event: EventListener | None = None,
        prefix_match: str = "token",
        tier: TierBooks | None = None,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        if prefix_match not in PREFIX_MATCH_MODES:
            raise ValueError(
                f"prefix_match must be one of {', '.join(PREFIX_MATCH_MODES)}, got {prefix_match!r}"
            )
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_match = prefix_match
        # Token-granular reuse runs only where there is a cache to reuse from.
        self._copies = enable_prefix_caching and prefix_match == "token"
        self.pool = pool = BlockPool(num_blocks)
        # The seed's names for the pool's books (the same objects).
        self.blocks = pool.blocks
        self.free_block_ids = pool.free_block_ids
        self.used_block_ids = pool.used_block_ids
        self.hash_to_block_id = pool.hash_to_block_id
        self.sources = CopySources(pool.blocks)
        self.stats = CacheStats()
        # Called with every event; None (or an empty EventBus) costs one truth test per change.
        self.on_event = on_event
        # The engine's step number, for the record of when a hash was evicted.
        self.step = 0
        self._explainer = MissExplainer(block_size, num_blocks)
        self.tier = tier  # the second tier's books (kv_tier; core/tier_hits.py), or None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_cached_free_blocks(self) -> int:
        return self.pool.num_cached_free_blocks

    @classmethod
    def compute_hash(cls, token_ids: list[int], prefix: int = -1) -> int:
        """The seed's name for ``hash_block_tokens``, which outside users call."""
        return hash_block_tokens(token_ids, prefix)

    def _block_hash(self, seq: Sequence, i: int) -> int:
        """Chained hash of full block ``i`` of ``seq``, memoized on the sequence."""
        hashes = seq.block_hashes
        while len(hashes) <= i:
            j = len(hashes)
            hashes.append(hash_block_tokens(seq.block(j), hashes[j - 1] if j else -1))
        return hashes[i]

    def _lookup(self, seq: Sequence, i: int) -> int:
        """Physical block holding logical block ``i`` of ``seq`` in the prefix cache, or -1."""
        return self.pool.cached(self._block_hash(seq, i), seq.block(i))

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
        another sequence right now, so that waiting a step or two turns it into a hit.
        Token-granular: also a prompt's last block that another sequence, mid-prefill, is
        filling with tokens this prompt shares."""
        i = num_cached_blocks
        if not self.enable_prefix_caching:
            return False
        if i < (len(seq) - 1) // self.block_size:
            if self._explainer.is_pending(self._block_hash(seq, i)):
                return True
        if not self._copies:
            return False
        return self._gain_by_waiting(seq, i) >= MIN_WAIT_TOKENS

    def is_filling(self, seq: Sequence, i: int) -> bool:
        """Whether a sequence mid-prefill is still computing tokens of block ``i`` of ``seq``
        that the two share."""
        return self._gain_by_waiting(seq, i) > 0

    def _gain_by_waiting(self, seq: Sequence, i: int) -> int:
        """The shared tokens of block ``i`` of ``seq`` that a sequence mid-prefill has yet to
        compute: what waiting for it would add to the best copy now (0 if none is filling)."""
        now = later = 0
        for source, shared, computed in self._sources(seq, i):
            now = max(now, computed)
            owner = self.blocks[source].owner
            if owner is not None and owner.is_prefill:
                later = max(later, shared)
        return max(0, later - now)

    def _sources(self, seq: Sequence, i: int) -> list[tuple[int, int, int]]:
        """Each block that continues ``seq``'s prefix before its block ``i``, as ``(block, tokens
        of block i it shares, of them computed)``: all but the prompt's last token at most; a
        source still being filled may share tokens whose K/V are not computed yet."""
        bs = self.block_size
        start = i * bs
        limit = min(bs, seq.num_tokens - 1 - start)
        if limit <= 0:
            return []
        parent = self._block_hash(seq, i - 1) if i else -1
        found = []
        for source in self.sources.continuing(parent, seq.token_ids[start]):
            block = self.blocks[source]
            if block.parent != parent:  # a key collision
                continue
            owner = block.owner
            if owner is None:
                n = common_prefix(block.token_ids, 0, seq.token_ids, start, limit)
                computed = n
            else:
                n = common_prefix(owner.token_ids, block.start, seq.token_ids, start, limit)
                computed = max(0, min(n, owner.num_cached_tokens - block.start))
            if n:
                found.append((source, n, computed))
        return found

    def _copyable(self, seq: Sequence, i: int) -> tuple[int, int]:
        """The source of the most computed tokens of block ``i`` of ``seq`` (the newest among
        equals) and how many, or ``(-1, 0)``."""
        best, most = -1, 0
        for source, _, computed in reversed(self._sources(seq, i)):
            if computed > most:
                best, most = source, computed
        return best, most

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
        # Past the cache's own hits, the run the second tier holds, fetched before anything
        # is counted (a block the tier cannot give back is a miss).
        fetched = tier_hits.restorable(self, seq, num_cached_blocks) if self.tier else []
        k = num_cached_blocks + len(fetched)
        source, copied = self._copyable(seq, k) if self._copies else (-1, 0)
        reason, evicted_at, partial = self._explainer.explain(self, seq, k, first, copied)
        hit_ids = [self._lookup(seq, i) for i in range(num_cached_blocks)]
        assert -1 not in hit_ids, (
            "allocate() was given more cached blocks than can_allocate() found"
        )
        shared = bs * sum(1 for b in hit_ids if self.blocks[b].ref_count)
        revived = bs * num_cached_blocks - shared
        self._count_lookup(seq, first, shared, revived, copied, reason, bs * len(fetched))
        seq.num_cached_tokens = k * bs + copied
        seq.kv_copy = None
        if self.on_event:
            self.on_event(
                CacheLookup(
                    seq.seq_id,
                    seq.num_tokens,
                    seq.num_cached_tokens,
                    first,
                    reason,
                    k,
                    evicted_at,
                    partial,
                )
            )
        blocks, table, emit = self.blocks, seq.block_table, self.on_event
        for block_id in hit_ids:
            block = blocks[block_id]
            kind = self.pool.take_hit(block)
            table.append(block_id)
            if emit:
                emit(BlockHit(seq.seq_id, block_id, block.hash, kind))
        for i, handle in enumerate(fetched, num_cached_blocks):
            tier_hits.restore(self, seq, i, handle)
        for _ in range(k, seq.num_blocks):
            self._allocate_free_block(seq)
        if copied:
            # The copy runs before the step's forward pass, before anything this step writes:
            # a source taken for new data in this very step (even as this destination) still
            # holds its K/V then, so it needs no pin.
            target = table[k]
            seq.kv_copy = (source, target, copied)
            if emit:
                emit(BlockCopied(seq.seq_id, target, source, copied))
        if self.enable_prefix_caching:
            if self._copies:
                self._own_tail(seq)
            self._explainer.admitted(self, seq, k)

    def _own_tail(self, seq: Sequence) -> None:
        """Offer ``seq``'s last block, if the prompt fills it only in part, as a copy source
        for the tokens it will hold: it continues the prompt's last full block."""
        bs = self.block_size
        i = len(seq.block_table) - 1
        if i < 0 or (i + 1) * bs <= seq.num_tokens:
            return  # its tokens fill it: once computed it is registered instead
        block = self.blocks[seq.block_table[i]]
        block.owner, block.start = seq, i * bs
        block.parent = self._block_hash(seq, i - 1) if i else -1
        self.sources.offer(block, seq.token_ids[i * bs])

    def _count_lookup(
        self,
        seq: Sequence,
        first: bool,
        shared: int,
        revived: int,
        copied: int,
        reason: str,
        restored: int = 0,
    ) -> None:
        stats = self.stats
        if first:
            stats.queries += seq.num_tokens
            stats.shared_hits += shared
            stats.revived_hits += revived
            stats.copied_hits += copied
            stats.restored_hits += restored
            seq.num_prefix_hit_tokens = shared + revived + copied + restored
            seq.num_prefix_restored_tokens = restored
        else:
            stats.readmission_queries += seq.num_tokens
            stats.readmission_shared_hits += shared
            stats.readmission_revived_hits += revived
            stats.readmission_copied_hits += copied
            stats.readmission_restored_hits += restored
        stats.miss_tokens[reason] += seq.num_tokens - shared - revived - copied - restored

    def _allocate_free_block(self, seq: Sequence) -> None:
        pool = self.pool
        head = pool.blocks[pool.free_block_ids.head()]
        # No copy source any more (its content is about to be overwritten), nor, if it holds
        # the last copy of cached content, a cached block: both before it is taken, so that a
        # block taken is one the table holds.
        self.sources.withdraw(head)
        if head.hash != -1 and pool.is_last_copy(head):
            self._evict(head)
        block = pool.take_free()
        block_id = block.block_id
        if self.tier is not None:
            self.tier.cancel(block_id)  # a restore not yet written would overwrite new data
        seq.block_table.append(block_id)
        if self.on_event:
            self.on_event(BlockAllocated(seq.seq_id, block_id))

    def _evict(self, block: Block) -> None:
        """The LRU cached block, the last copy of its content, is about to be overwritten:
        the content leaves the cache. An eviction is a change of its own, announced before
        the block is taken (one event per change, so a listener that raises cannot leave
        another listener with half of one)."""
        h, token_ids = block.hash, block.token_ids
        self.pool.uncache(block)
        self.stats.evictions += 1
        self._explainer.evicted(h, self.step)
        if self.on_event:
            self.on_event(BlockRemoved(block.block_id, h))
        if self.tier is not None:  # its K/V are still in the block: nothing overwrote them
            tier_hits.to_tier(self, block.block_id, h, token_ids)

    def deallocate(self, seq: Sequence) -> None:
        """Let go of ``seq``'s blocks, last first. Each block leaves the table once its books
        balance, so a release cut short by an exception leaves exactly the blocks still held
        in the table, and calling again finishes it."""
        emit = self.on_event
        if self.enable_prefix_caching:
            self._explainer.released(seq)
            if self._copies:
                self._leave_tail(seq)
        seq.kv_copy = None
        table, blocks, pool = seq.block_table, self.blocks, self.pool
        # Walking the table backwards queues a sequence's tail blocks ahead of its prefix in
        # the free queue, so the prefix (the part other requests share) is evicted last.
        while table:
            block_id = table[-1]
            block = blocks[block_id]
            pool.release(block)
            table.pop()
            if emit:
                emit(BlockFreed(seq.seq_id, block_id, block.ref_count))
        seq.num_cached_tokens = 0

    def _leave_tail(self, seq: Sequence) -> None:
        """``seq`` stops filling its last block: what it computed there stays a copy source
        (until the block is taken for new data), or nothing if it computed none of it."""
        if not seq.block_table:
            return
        block = self.blocks[seq.block_table[-1]]
        if block.owner is not seq:
            return
        n = seq.num_cached_tokens - block.start
        if n > 0:
            block.token_ids = seq.token_ids[block.start : block.start + n]
        else:
            self.sources.withdraw(block)
        block.owner = None

    def can_append(self, seq: Sequence) -> bool:
        # A decode step needs a new block only when the token to compute opens one:
        # len(seq) % block_size == 1, written so that block_size 1 works too.
        return len(self.free_block_ids) >= ((seq.num_tokens - 1) % self.block_size == 0)

    def may_append(self, seq: Sequence) -> None:
        # The token about to be computed is the last one; it needs a new block when it opens one.
        if len(seq.block_table) * self.block_size < seq.num_tokens:
            self._allocate_free_block(seq)
            if self._copies:
                self._own_tail(seq)

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
            token_ids = seq.block(i)
            parent = seq.block_hashes[i - 1] if i else -1
            # The explainer's hint first: the books change after every call that may raise
            # (a hint about a hash never registered is looked up and found missing).
            explainer.stored(h, parent, token_ids[0])
            self.pool.register(block, h, token_ids)
            if self.on_event:
                self.on_event(BlockStored(block.block_id, h, parent, token_ids))
            # Announced first: a block the cache holds is one the events name, while a block
            # an interrupt leaves unoffered is merely no copy source.
            if self._copies:  # the newest continuation of its prefix
                block.parent = parent
                self.sources.offer(block, token_ids[0])
        explainer.progressed(self, seq, start, end)

    def reclaim(self, prefilling: list[Sequence]) -> None:
        """Rebuild the claims on blocks being computed from the sequences mid-prefill (after
        an exception cut a step short, the claims may name sequences that no longer compute)."""
        if self.enable_prefix_caching:
            self._explainer.reclaim(self, prefilling)

    def reset_prefix_cache(self) -> None:
        """Forget every registered hash (e.g. after weights change)."""
        self.pool.clear()
        self.sources.clear()
        self._explainer.cleared()
        if self.tier is not None:
            self.tier.clear()
        if self.on_event:
            self.on_event(AllBlocksCleared())

    def check_invariants(self, live_seqs: list[Sequence] | None = None) -> None:
        """Assert the books balance. With ``live_seqs``, ref counts must equal table membership."""
        n = len(self.blocks)
        self.pool.check()
        self.sources.check()
        if self.tier is not None:
            self.tier.check()
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
