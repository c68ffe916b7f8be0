"""A physical KV block's books and the FIFO queue of free blocks (``BlockPool`` keeps both)."""

from __future__ import annotations

import sys
from array import array
from collections import OrderedDict
from collections.abc import Iterator
from collections.abc import Sequence as TokenIds

import numpy as np
import xxhash

from ..sequence import Sequence

_LITTLE_ENDIAN = sys.byteorder == "little"


def hash_block_tokens(token_ids: TokenIds[int], parent: int = -1) -> int:
    """The chained hash of one block: xxh64 over the parent block's hash (none for a first
    block: ``parent=-1``) and the block's token ids as little-endian int64. It stands for the
    whole prefix up to and including the block. The engine registers blocks under it, and
    traces, what-ifs and KV events name blocks by it."""
    h = xxhash.xxh64()
    if parent != -1:
        h.update(parent.to_bytes(8, "little"))
    if isinstance(token_ids, array) and token_ids.typecode == "q" and _LITTLE_ENDIAN:
        h.update(token_ids)  # already little-endian int64 bytes: no conversion
    else:
        h.update(np.asarray(token_ids, dtype="<i8").tobytes())
    return h.intdigest()


def common_prefix(a, a_start: int, b, b_start: int, limit: int) -> int:
    """How many of the ``limit`` tokens from ``a[a_start]`` and ``b[b_start]`` on agree."""
    n = min(limit, len(a) - a_start, len(b) - b_start)
    if n <= 0:
        return 0
    x, y = a[a_start : a_start + n], b[b_start : b_start + n]
    if same_tokens(x, y):
        return n
    for i, (p, q) in enumerate(zip(x, y)):
        if p != q:
            return i
    return n


def same_tokens(a, b) -> bool:
    if type(a) is type(b):
        return a == b
    return list(a) == list(b)  # a list and an int64 array: rare, compare element-wise


class Block:
    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1
        # A registered block's tokens; or, hash -1, the computed tokens of a partly filled
        # last block its sequence left behind (a source for token-granular reuse).
        self.token_ids: list[int] = []
        # Token-granular reuse: the prefix this block's content continues (-1: none), its key
        # in CopySources (0: not a source), and while a sequence is still filling it,
        # that sequence and the block's first position in it.
        self.parent = -1
        self.tail_key = 0
        self.owner: Sequence | None = None
        self.start = 0

    def update(self, hash: int, token_ids: list[int]) -> None:
        self.hash = hash
        self.token_ids = token_ids
        self.owner = None  # full now: its content is token_ids

    def reset(self) -> None:
        self.ref_count = 1
        self.hash = -1
        self.token_ids = []
        self.owner = None

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
