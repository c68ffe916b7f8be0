"""The block manager's books of its second tier: which evicted blocks the tier holds.

A tier keeps K/V (disk.py, host.py); the block manager decides with these books, without
reading it: each held block's chained hash and a digest of its tokens, least recently used
first, at most the tier's capacity in blocks. What moves data is a backend: a dry run's
``SimulatedTier`` moves none (a tier of hashes; its cost model charges the restore time), a
model run's ``ModelTier`` (model_tier.py) stores from and restores into the runner's cache.
A model run's books mirror its tier (the same capacity, the same order of stores and hits),
and the tier's own checks on load stay the truth: a block the books hold but the tier cannot
give back intact is a miss, and leaves the books.

Restore only when it pays: a block is restored while reading it (its bytes over the tier's
bandwidth) takes less time than recomputing its tokens (``block_size`` over the prefill
speed). The comparison is per block and the same for every block of a run, so it is one
test per lookup (``pays``), made again as a model run measures its prefill speed.
"""

from __future__ import annotations

import sys
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import xxhash

_LITTLE_ENDIAN = sys.byteorder == "little"


def token_digest(token_ids: Sequence[int]) -> int:
    """A 64-bit digest of a block's token ids (as little-endian int64, the tier's bytes): what
    the books verify a lookup by, instead of keeping every block's tokens (a dry run of a long
    trace holds hundreds of thousands). The tier itself compares the tokens in full."""
    if isinstance(token_ids, (bytes, bytearray)):
        return xxhash.xxh3_64_intdigest(token_ids)
    if isinstance(token_ids, array) and token_ids.typecode == "q" and _LITTLE_ENDIAN:
        return xxhash.xxh3_64_intdigest(token_ids)  # little-endian int64 already: no copy
    return xxhash.xxh3_64_intdigest(np.asarray(token_ids, dtype="<i8").tobytes())


class TierBackend(Protocol):
    """What moves (or, in a dry run, times) a tier's data for the books.

    ``save`` keeps block ``block_id``'s K/V under its hash (False: not kept). ``fetch`` reads
    a held block into a staging place and returns a handle to it, None when it cannot be read
    back intact; ``place`` hands a fetched block to the block it is restored into, whose K/V
    the runner writes before its next forward pass, and ``cancel`` drops a placed block not
    yet written (its block is taken for other data). ``held`` lists what the tier held when
    it was opened (hash, token bytes), least recently used first: a restart's blocks.
    """

    medium: str
    capacity_blocks: int
    block_bytes: int
    bandwidth: float  # bytes per second

    def save(self, block_id: int, block_hash: int, token_ids: Sequence[int]) -> bool: ...

    def fetch(self, block_hash: int, token_ids: Sequence[int]) -> Any | None: ...

    def place(self, block_id: int, handle: Any) -> None: ...

    def cancel(self, block_id: int) -> None: ...

    def held(self) -> list[tuple[int, bytes]]: ...

    def recompute_s_per_token(self) -> float | None: ...


class TierBooks:
    """The hashes a tier holds, least recently used first, bounded by its capacity."""

    def __init__(self, backend: TierBackend, block_size: int) -> None:
        self.backend = backend
        self.medium = backend.medium
        self.block_size = block_size
        self.capacity_blocks = backend.capacity_blocks
        self.restore_s_per_block = backend.block_bytes / backend.bandwidth
        self._held: OrderedDict[int, int] = OrderedDict()  # hash -> token digest
        for block_hash, tokens in backend.held()[-self.capacity_blocks :]:
            self._held[block_hash] = token_digest(tokens)
        self.found_at_start = len(self._held)  # blocks a restart found stored before
        self.stored = 0  # blocks stored since (a block stored again counts once more)
        self.dropped = 0  # blocks let go: to make room, or not read back intact

    @property
    def num_blocks(self) -> int:
        return len(self._held)

    def holds(self, block_hash: int, token_ids: Sequence[int]) -> bool:
        return self._held.get(block_hash) == token_digest(token_ids)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._held

    def pays(self) -> bool:
        """Whether restoring a block takes less time than recomputing it (yes while a model
        run has not measured its prefill speed yet: a tier was asked for)."""
        per_token = self.backend.recompute_s_per_token()
        return per_token is None or self.restore_s_per_block < per_token * self.block_size

    def store(self, block_id: int, block_hash: int, token_ids: Sequence[int]) -> list[int]:
        """Keep evicted block ``block_id``'s content; the hashes let go to make room (the
        least recently used), with ``block_hash`` itself last when it could not be kept."""
        digest = token_digest(token_ids)
        held = self._held.get(block_hash)
        if not self.backend.save(block_id, block_hash, token_ids):
            if held is None:
                return []
            del self._held[block_hash]  # the tier may have dropped it: a failed write
            self.dropped += 1
            return [block_hash]
        dropped = []
        if held is None:
            while len(self._held) >= self.capacity_blocks:
                dropped.append(self._held.popitem(last=False)[0])
            self.dropped += len(dropped)
        self._held[block_hash] = digest
        self._held.move_to_end(block_hash)
        self.stored += 1
        return dropped

    def fetch(self, block_hash: int, token_ids: Sequence[int]) -> Any | None:
        """A held block read back for restoring (a handle for ``place``), or None: not
        held, or not intact (then it leaves the books)."""
        if not self.holds(block_hash, token_ids):
            return None
        handle = self.backend.fetch(block_hash, token_ids)
        if handle is None:
            del self._held[block_hash]
            self.dropped += 1
            return None
        self._held.move_to_end(block_hash)
        return handle

    def place(self, block_id: int, handle: Any) -> None:
        self.backend.place(block_id, handle)

    def cancel(self, block_id: int) -> None:
        self.backend.cancel(block_id)

    def clear(self) -> None:
        """Forget every block (the prefix cache was reset: the weights may have changed)."""
        self._held.clear()

    def check(self) -> None:
        """Assert the books' bound."""
        assert len(self._held) <= self.capacity_blocks, (
            f"the tier's books hold {len(self._held)} blocks, above its {self.capacity_blocks}"
        )


class SimulatedTier:
    """A dry run's tier: a capacity and a restore time, no data. ``take_seconds`` hands the
    time of the restores placed since it was last called to the dry run's clock."""

    def __init__(
        self,
        medium: str,
        capacity_blocks: int,
        block_bytes: int,
        bandwidth: float,
        recompute_s_per_token: float,
    ) -> None:
        self.medium = medium
        self.capacity_blocks = capacity_blocks
        self.block_bytes = block_bytes
        self.bandwidth = bandwidth
        self._recompute = recompute_s_per_token
        self._seconds = 0.0

    def save(self, block_id: int, block_hash: int, token_ids: Sequence[int]) -> bool:
        return True

    def fetch(self, block_hash: int, token_ids: Sequence[int]) -> bool:
        return True

    def place(self, block_id: int, handle: Any) -> None:
        self._seconds += self.block_bytes / self.bandwidth

    def cancel(self, block_id: int) -> None:
        pass  # the read happened: its time stays charged

    def held(self) -> list[tuple[int, bytes]]:
        return []

    def recompute_s_per_token(self) -> float:
        return self._recompute

    def take_seconds(self) -> float:
        seconds, self._seconds = self._seconds, 0.0
        return seconds
