"""Why a prompt lookup missed: one reason per lookup, for the first block that did not hit.

The BlockManager calls in at each change that bears on a later explanation (a block allocated,
computed, registered, evicted or overwritten) and asks ``explain`` at each admission. The
reasons, tested in this order (the first that applies wins; ``cache_stats.MISS_REASONS``):

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
the latest eviction wins), and for ``partial`` and the token-granular reasons the newest few
continuations of each prefix (``CONTINUATIONS_KEPT``, as ``CopySources`` keeps blocks),
each a registered block's hash (looked up again when asked: an evicted one no longer counts) or
a prompt's partial last block (its tokens), pruned oldest first past a few times the cache's
block count. A few, not the newest only: a running sequence that parts from a prompt early must
not hide an older prompt that shared all of it, or a miss of the latter's tokens reads
``cold``.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from typing import Protocol

from ..sequence import Sequence

# Continuations of one prefix kept (copy sources in the BlockManager, known ones here): a
# bounded search per lookup, and enough for a repeated prompt among a few running sequences
# that share its prefix.
CONTINUATIONS_KEPT = 4


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
        # _key(parent hash, first token) -> the known continuations of that prefix: each a
        # registered block's hash or a partial last block's prompt tokens (an int64 array), one
        # alone or a list of them (oldest first) where several are known. Ints and arrays for
        # the common single one, no tuples: one entry per block computed, and containers would
        # feed the garbage collector.
        self._known: dict[int, int | array | list[int | array]] = {}
        # Entries past the first of each key: counted against _max_known with the keys, so
        # keeping several per prefix holds no more than keeping one did.
        self._extra_known = 0
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
        mine = seq.token_ids[k * bs : (k + 1) * bs]
        most, evicted_at = 0, None
        for known in self._continuations(bm, seq, k):
            if isinstance(known, int):  # registered, then evicted: its tokens are gone
                evicted_at = self._evicted_at.get(known, -1)
            else:
                most = max(most, _count_shared(mine, known))
        if most > copied:
            # One that shares more than could be copied: still being computed, or gone.
            if bm.is_filling(seq, k):
                return "in-flight", -1, 0
            return "evicted", -1, 0
        if evicted_at is not None:
            return "evicted", evicted_at, 0
        return "cold", -1, 0

    def _shared_tokens(self, bm: _Books, seq: Sequence, k: int) -> int:
        """The most tokens block ``k`` of ``seq`` has in common with a known continuation of
        the same parent prefix that starts with the same token, short of the whole block (0 if
        there is none)."""
        bs = self.block_size
        mine = seq.token_ids[k * bs : (k + 1) * bs]
        most = 0
        for known in self._continuations(bm, seq, k):
            if not isinstance(known, int):  # an int: evicted since, its content is gone
                n = _count_shared(mine, known)
                if n < bs:
                    most = max(most, n)
        return most

    def _continuations(self, bm: _Books, seq: Sequence, k: int) -> list:
        """The known continuations of block ``k``'s parent prefix starting with its first
        token: the tokens of each, or the hash of a registered one since evicted (an int)."""
        bs = self.block_size
        known = self._known.get(_key(seq.block_hashes[k - 1] if k else -1, seq.token_ids[k * bs]))
        if known is None:
            return []
        found = []
        for entry in known if type(known) is list else (known,):
            if isinstance(entry, int):
                block_id = bm.hash_to_block_id.get(entry)
                if block_id is not None:
                    entry = bm.blocks[block_id].token_ids
            found.append(entry)
        return found

    def _remember(self, key: int, entry: int | array) -> None:
        """Add ``entry`` as the newest known continuation under ``key`` (an equal one moves)."""
        old = self._known.get(key)
        if old is None:
            self._known[key] = entry
            return
        kept = [
            e
            for e in (old if type(old) is list else [old])
            if not (type(e) is type(entry) and e == entry)
        ]
        kept.append(entry)
        del kept[:-CONTINUATIONS_KEPT]
        self._extra_known += len(kept) - (len(old) if type(old) is list else 1)
        self._known[key] = kept if len(kept) > 1 else kept[0]

    # -- what happened -------------------------------------------------------------------------

    def admitted(self, bm: _Books, seq: Sequence, num_cached_blocks: int) -> None:
        """``seq`` got its blocks and computes from block ``num_cached_blocks`` on."""
        self._claim_next(bm, seq, num_cached_blocks)
        bs = self.block_size
        full = seq.num_tokens // bs
        if full < len(seq.block_table):  # a partial last block: remember what the prompt holds
            tail = array("q", seq.token_ids[full * bs :])  # not a list: one list holds several
            self._remember(_key(bm._block_hash(seq, full - 1) if full else -1, tail[0]), tail)

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
        known = self._known
        if len(known) + self._extra_known > self._max_known:  # drop the oldest half
            for key in list(known)[: len(known) // 2]:
                del known[key]
            self._extra_known = sum(len(v) - 1 for v in known.values() if type(v) is list)

    def stored(self, block_hash: int, parent_hash: int, first_token: int) -> None:
        # _key, inlined: this runs for every block registered; most are a prefix's only
        # known continuation, one dict look-up.
        key = (parent_hash * _MIX + first_token) & _MASK
        old = self._known.get(key)
        if old is None or old == block_hash:
            self._known[key] = block_hash
        else:
            self._remember(key, block_hash)

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
        self._extra_known = 0


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
