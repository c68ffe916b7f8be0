"""Why a prompt lookup missed: one reason per lookup, for the first block that did not hit.

The BlockManager calls in at each change that bears on a later explanation (a block allocated,
computed, registered, evicted or overwritten) and asks ``explain`` at each admission. The
reasons, tested in this order (the first that applies wins; ``block_manager.MISS_REASONS``):

* ``disabled``: prefix caching is off.
* ``preempted``: a re-admission after preemption recomputes what it lost.
* ``last-block``: every full block before it hit; the block holding the prompt's last token is
  always computed (a step needs one token to produce logits). Whole-block reuse only.
* ``last-token``: token-granular reuse served every token but the prompt's last, which is
  always computed.
* ``in-flight``: another sequence is computing this very block now (the scheduler holds such
  followers back until the block is registered, so this should stay near zero).
* ``evicted``: the block was cached once and evicted (at ``evicted_at_step``).
* ``partial``: an earlier prompt shared this prefix but diverged inside this block
  (``partial_tokens`` tokens of it in common, fewer than the block size). Whole-block reuse
  only: token-granular reuse copies those tokens.
* ``cold``: no earlier prompt computed this prefix (token-granular: up to and including the
  first missed token; what was shared before it was copied).

Under token-granular reuse ``evicted`` also covers an earlier continuation of the prefix that
shared more of the block than was copied: its K/V had left the cache (step -1 when the block
was a partial one, never registered, so not counted in ``evictions``); and ``in-flight`` one
whose tokens another sequence was still computing (a follower waits for them only when that
gains at least ``MIN_WAIT_TOKENS``).

What it keeps: the next block each prefilling sequence is computing (its claim, which
``in-flight`` and the scheduler's in-batch sharing test), the evicted hashes (one int each,
the latest eviction wins), and for ``partial`` the newest continuation of each prefix, a
registered block's hash (looked up again when asked: an evicted one no longer counts) or a
prompt's partial last block (its tokens), pruned oldest first past a few times the cache's
block count.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from .sequence import Sequence


class _Books(Protocol):
    """What the explainer reads of the BlockManager (typed here, so that this module does not
    import the one that imports it)."""

    enable_prefix_caching: bool
    prefix_match: str
    hash_to_block_id: dict[int, int]
    blocks: list

    def _block_hash(self, seq: Sequence, i: int) -> int: ...

    def is_filling(self, seq: Sequence, i: int) -> bool: ...


class MissExplainer:
    def __init__(self, block_size: int, num_blocks: int) -> None:
        self.block_size = block_size
        self._max_known = 4 * num_blocks
        self._pending: dict[int, int] = {}  # hash -> block being computed for it
        self._evicted_at: dict[int, int] = {}  # hash -> step it was last evicted at
        # _key(parent hash, first token) -> a known continuation of that prefix: a registered
        # block's hash, or a partial last block's prompt tokens. Ints and arrays only, no
        # tuples: one entry per block computed, and tuples would feed the garbage collector.
        self._known: dict[int, int | list[int]] = {}
        # Called for every eviction: the dict's own C method, no Python frame in between.
        self.evicted = self._evicted_at.__setitem__  # (hash, step)

    # -- questions ---------------------------------------------------------------------------

    def is_pending(self, block_hash: int) -> bool:
        return block_hash in self._pending

    def explain(
        self, bm: _Books, seq: Sequence, num_cached_blocks: int, first: bool, copied: int = 0
    ) -> tuple[str, int, int]:
        """``(reason, evicted_at_step, partial_tokens)`` for a lookup that hit
        ``num_cached_blocks`` blocks and then ``copied`` tokens (-1 and 0 where they do not
        apply)."""
        if not bm.enable_prefix_caching:
            return "disabled", -1, 0
        if not first:
            return "preempted", -1, 0
        k = num_cached_blocks
        if bm.prefix_match == "token":
            return self._explain_tokens(bm, seq, k, copied)
        if k >= (len(seq) - 1) // self.block_size:
            return "last-block", -1, 0
        h = bm._block_hash(seq, k)
        if h in self._pending:
            return "in-flight", -1, 0
        step = self._evicted_at.get(h)
        if step is not None:
            return "evicted", step, 0
        shared = self._shared_tokens(bm, seq, k)
        if shared:
            return "partial", -1, shared
        return "cold", -1, 0

    def _explain_tokens(
        self, bm: _Books, seq: Sequence, k: int, copied: int
    ) -> tuple[str, int, int]:
        bs = self.block_size
        if k * bs + copied >= len(seq) - 1:
            return "last-token", -1, 0
        if k < (len(seq) - 1) // bs:  # a full block of the prompt: it may have a hash
            h = bm._block_hash(seq, k)
            if h in self._pending:
                return "in-flight", -1, 0
            step = self._evicted_at.get(h)
            if step is not None:
                return "evicted", step, 0
        known = self._continuation(bm, seq, k)
        if isinstance(known, int):  # that continuation was registered, then evicted
            return "evicted", self._evicted_at.get(known, -1), 0
        if (
            known is not None
            and _count_shared(seq.token_ids[k * bs : (k + 1) * bs], known) > copied
        ):
            # Shared more than could be copied: still being computed, or gone.
            if bm.is_filling(seq, k):
                return "in-flight", -1, 0
            return "evicted", -1, 0
        return "cold", -1, 0

    def _shared_tokens(self, bm: _Books, seq: Sequence, k: int) -> int:
        """Tokens block ``k`` of ``seq`` has in common with the known continuation of the same
        parent prefix that starts with the same token (0 if there is none)."""
        known = self._continuation(bm, seq, k)
        if known is None or isinstance(known, int):
            return 0  # none, or evicted since: its content is gone
        bs = self.block_size
        n = _count_shared(seq.token_ids[k * bs : (k + 1) * bs], known)
        return n if n < bs else 0

    def _continuation(self, bm: _Books, seq: Sequence, k: int):
        """The known continuation of block ``k``'s parent prefix starting with its first token:
        its tokens, the hash of a registered one since evicted (an int), or None."""
        bs = self.block_size
        known = self._known.get(_key(seq.block_hashes[k - 1] if k else -1, seq.token_ids[k * bs]))
        if isinstance(known, int):
            block_id = bm.hash_to_block_id.get(known)
            if block_id is not None:
                return bm.blocks[block_id].token_ids
        return known

    # -- what happened -------------------------------------------------------------------------

    def admitted(self, bm: _Books, seq: Sequence, num_cached_blocks: int) -> None:
        """``seq`` got its blocks and computes from block ``num_cached_blocks`` on."""
        self._claim_next(bm, seq, num_cached_blocks)
        bs = self.block_size
        full = seq.num_tokens // bs
        if full < len(seq.block_table):  # a partial last block: remember what the prompt holds
            tail = seq.token_ids[full * bs :]  # a copy (list or int64 array)
            self._known[_key(bm._block_hash(seq, full - 1) if full else -1, tail[0])] = tail

    def _claim_next(self, bm: _Books, seq: Sequence, i: int) -> None:
        # Only a sequence's next uncomputed full block is claimed: a follower waits for the
        # first block it misses, and every later block is claimed as the one before is done.
        if i < seq.num_tokens // self.block_size:
            self._pending.setdefault(bm._block_hash(seq, i), seq.block_table[i])

    def progressed(self, bm: _Books, seq: Sequence, start: int, end: int) -> None:
        """Blocks ``start`` to ``end - 1`` of ``seq`` were computed (and registered)."""
        hashes = seq.block_hashes
        if start < len(hashes) and self._pending.get(hashes[start]) == seq.block_table[start]:
            del self._pending[hashes[start]]
        self._claim_next(bm, seq, end)
        if len(self._known) > self._max_known:  # drop the oldest half
            for key in list(self._known)[: len(self._known) // 2]:
                del self._known[key]

    def stored(self, block_hash: int, parent_hash: int, first_token: int) -> None:
        # _key, inlined: this runs for every block registered.
        self._known[(parent_hash * _MIX + first_token) & _MASK] = block_hash

    def released(self, seq: Sequence) -> None:
        """``seq`` lets go of its blocks: the block it claimed will not be computed by it."""
        i = seq.num_cached_tokens // self.block_size
        if i < len(seq.block_hashes) and i < len(seq.block_table):
            h = seq.block_hashes[i]
            if self._pending.get(h) == seq.block_table[i]:
                del self._pending[h]

    def reclaim(self, bm: _Books, prefilling: list[Sequence]) -> None:
        """Claims as they stand when nothing is cut short: each sequence mid-prefill claims the
        block it computes next (the first claimer of a hash keeps it, as in ``_claim_next``)."""
        self._pending.clear()
        for seq in prefilling:
            self._claim_next(bm, seq, seq.num_cached_tokens // self.block_size)

    def claimed_blocks(self) -> Iterable[int]:
        return self._pending.values()

    def cleared(self) -> None:
        self._evicted_at.clear()
        self._known.clear()


_MIX, _MASK = 0x9E3779B97F4A7C15, 0xFFFFFFFFFFFFFFFF


def continuation_key(parent_hash: int, first_token: int) -> int:
    """One int for (the hash of a prefix, the first token of the block continuing it). A
    collision only makes a lookup compare against the wrong block, and the token comparison
    then finds nothing in common."""
    return (parent_hash * _MIX + first_token) & _MASK


_key = continuation_key


def _count_shared(a, b) -> int:
    """How many leading tokens ``a`` and ``b`` have in common."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
