"""What every KV tier offers the engine, and the checks its arguments share.

A tier keeps blocks the device cache evicted, keyed by the block manager's chained hash and
verified by the block's token ids, so a later prompt can restore a block instead of
recomputing it. A tier is an optimisation: its faults cost misses, never wrong K/V and never
an exception during serving. Only opening one may fail, with TierUnavailable, whose message
is the one line the engine shows before it runs on without the tier.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from .fingerprint import Fingerprint

# The block manager's hashes are xxh64 digests: unsigned 64-bit.
MAX_BLOCK_HASH = 2**64 - 1


class TierUnavailable(RuntimeError):
    """A tier cannot be opened (path unusable, disk full, in use by another process...)."""


@dataclass
class TierStats:
    """A tier's counters since it was opened.

    ``already_stored``: stores of a block the tier held (no write). ``corrupt_dropped``:
    entries found damaged (torn writes, flipped bytes), at open or on load, and forgotten.
    ``resets``: files set aside as unreadable (another format or fingerprint) and started
    afresh, the latest reason in ``reset_reason``. ``errors``: failed I/O or allocations.
    ``disabled``: why the tier stopped serving, None while it serves. ``note``: a change
    worth a line in the log (say, capacity cut to what the disk could hold).
    """

    stores: int = 0
    already_stored: int = 0
    loads: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    corrupt_dropped: int = 0
    resets: int = 0
    errors: int = 0
    reset_reason: str | None = None
    disabled: str | None = None
    note: str | None = None

    def as_dict(self) -> dict:
        return asdict(self)


@runtime_checkable
class Tier(Protocol):
    """The API of HostTier and DiskTier.

    ``store`` keeps a copy of a full block's K/V (``kv``, shaped like ``kv_cache[:, :, b]``)
    under its hash and tokens, evicting the least recently used entry when full; False when
    it cannot (disabled, closed, write failed). ``load`` copies a stored block into ``out``
    and returns True only for the same hash and the same token ids, intact; on False ``out``
    is untouched, except after a failed integrity check, when its contents are unspecified
    (the caller recomputes the block into it anyway). ``used_bytes`` and ``capacity_bytes``
    count K/V payload, so ``capacity_bytes // block_bytes`` blocks fit. ``entries`` lists
    what it holds, (hash, token bytes), least recently used first.
    """

    fingerprint: Fingerprint

    def store(self, block_hash: int, token_ids: Sequence[int], kv: torch.Tensor) -> bool: ...

    def load(self, block_hash: int, token_ids: Sequence[int], out: torch.Tensor) -> bool: ...

    def __contains__(self, block_hash: object) -> bool: ...

    def entries(self) -> list[tuple[int, bytes]]: ...

    def __len__(self) -> int: ...

    @property
    def used_bytes(self) -> int: ...

    @property
    def capacity_bytes(self) -> int: ...

    def stats(self) -> TierStats: ...

    def close(self) -> None: ...


def block_tokens(fingerprint: Fingerprint, token_ids: Sequence[int]) -> bytes:
    """The token ids of a full block as little-endian int64 bytes: how tiers keep and compare
    them (one bytes comparison instead of a Python loop)."""
    tokens = np.asarray(token_ids, dtype="<i8")
    if tokens.shape != (fingerprint.block_size,):
        raise ValueError(
            f"a tier holds full blocks of {fingerprint.block_size} tokens, "
            f"got {tokens.size} token ids"
        )
    return tokens.tobytes()


def check_block_tensor(fingerprint: Fingerprint, tensor: torch.Tensor, name: str) -> None:
    """ValueError unless ``tensor`` is one block of the fingerprint's cache."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tuple(tensor.shape) != fingerprint.block_shape or tensor.dtype != fingerprint.torch_kv_dtype:
        raise ValueError(
            f"{name} must be one block {list(fingerprint.block_shape)} of "
            f"{fingerprint.kv_dtype}, got {list(tensor.shape)} of "
            f"{str(tensor.dtype).removeprefix('torch.')}"
        )


def block_hash_of(block_hash: int) -> int:
    """``block_hash`` as a Python int (numpy integers too); ValueError unless it is an
    unsigned 64-bit integer, the only kind the block manager makes."""
    if isinstance(block_hash, bool):
        raise ValueError("block hash must be an int, got bool")
    try:
        value = operator.index(block_hash)
    except TypeError:
        raise ValueError(f"block hash must be an int, got {type(block_hash).__name__}") from None
    if not 0 <= value <= MAX_BLOCK_HASH:
        raise ValueError(f"block hash must be an unsigned 64-bit int, got {value}")
    return value
