"""A KV tier in host memory: an LRU of CPU copies of evicted blocks, gone with the process.

Meant for a CUDA cache, where host memory is larger than the device's and a restore is one
host-to-device copy. The copies are pinned (page-locked) when asked and CUDA is present, so
that copy runs at full PCIe bandwidth. Pinning is slow, so buffers are allocated as the tier
fills and then reused (an evicted entry's buffer takes the next block) rather than freed.
Copies are synchronous: an asynchronous one could still be reading a buffer that a later
store overwrites.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import replace

import torch

from .base import TierStats, TierUnavailable, block_hash_of, block_tokens, check_block_tensor
from .buffers import staging_like
from .fingerprint import Fingerprint
from .spec import format_size


class HostTier:
    """At most ``size_bytes`` of K/V in CPU memory (pinned when ``pin`` and CUDA is there)."""

    medium = "host"

    def __init__(self, size_bytes: int, fingerprint: Fingerprint, pin: bool = True):
        if isinstance(size_bytes, bool) or not isinstance(size_bytes, int) or size_bytes <= 0:
            raise ValueError(f"size_bytes must be a positive int, got {size_bytes!r}")
        self.fingerprint = fingerprint
        self.size_bytes = size_bytes
        self.block_bytes = fingerprint.block_bytes
        self.capacity_blocks = size_bytes // self.block_bytes
        if self.capacity_blocks < 1:
            raise TierUnavailable(
                f"KV host tier: {format_size(size_bytes)} holds no block "
                f"(one takes {self.block_bytes} bytes)"
            )
        self.pin = pin and torch.cuda.is_available()
        self._entries: OrderedDict[int, tuple[bytes, torch.Tensor]] = OrderedDict()
        self._stats = TierStats()
        self._closed = False
        self._mutex = threading.Lock()

    def store(self, block_hash: int, token_ids: Sequence[int], kv: torch.Tensor) -> bool:
        """Keep a copy of ``kv`` (one block) under ``block_hash`` and ``token_ids``; False
        when closed or when host memory runs out."""
        block_hash = block_hash_of(block_hash)
        tokens = block_tokens(self.fingerprint, token_ids)
        check_block_tensor(self.fingerprint, kv, "kv")
        with self._mutex:
            if self._closed:
                return False
            return self._keep(block_hash, tokens, kv)

    def _keep(self, block_hash: int, tokens: bytes, kv: torch.Tensor) -> bool:
        held = self._entries.get(block_hash)
        if held is not None and held[0] == tokens:
            self._entries.move_to_end(block_hash)
            self._stats.already_stored += 1
            return True
        # A colliding hash hands its buffer over; otherwise a new one, or the LRU entry's.
        buffer = self._entries.pop(block_hash)[1] if held is not None else self._buffer()
        if buffer is None:
            return False
        try:
            buffer.copy_(kv)
        except BaseException:
            # The buffer holds no block's K/V now: it is dropped rather than kept half copied.
            self._stats.errors += 1
            raise
        self._entries[block_hash] = (tokens, buffer)
        self._stats.stores += 1
        self._stats.bytes_written += self.block_bytes
        return True

    def load(self, block_hash: int, token_ids: Sequence[int], out: torch.Tensor) -> bool:
        """Copy the block under ``block_hash`` into ``out``; True only for the same token
        ids. ``out`` is untouched on False."""
        block_hash = block_hash_of(block_hash)
        tokens = block_tokens(self.fingerprint, token_ids)
        check_block_tensor(self.fingerprint, out, "out")
        with self._mutex:
            self._stats.loads += 1
            held = self._entries.get(block_hash)
            if held is None or held[0] != tokens:
                self._stats.misses += 1
                return False
            out.copy_(held[1])
            self._entries.move_to_end(block_hash)
            self._stats.hits += 1
            self._stats.bytes_read += self.block_bytes
            return True

    def _buffer(self) -> torch.Tensor | None:
        """A buffer for one more block: new while the tier fills, the least recently used
        entry's once full. None when memory for a new one cannot be had."""
        if len(self._entries) >= self.capacity_blocks:
            _, (_, buffer) = self._entries.popitem(last=False)
            self._stats.evictions += 1
            return buffer
        shape, dtype = self.fingerprint.block_shape, self.fingerprint.torch_kv_dtype
        try:
            buffer = staging_like(shape, dtype, pin=self.pin)
        except (RuntimeError, MemoryError) as exc:
            self._stats.errors += 1
            if not self._entries:
                self._stats.note = f"host memory for the KV tier ran out: {exc}"
                return None
            # Hold what fits: cap the tier at its present size and reuse the LRU entry.
            self.capacity_blocks = len(self._entries)
            self._stats.note = f"host memory ran out: KV host tier capped at {len(self)} blocks"
            return self._buffer()
        return buffer

    def entries(self) -> list[tuple[int, bytes]]:
        """What the tier holds, as (hash, token bytes), least recently used first."""
        with self._mutex:
            return [(h, tokens) for h, (tokens, _) in self._entries.items()]

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def used_bytes(self) -> int:
        return len(self._entries) * self.block_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.capacity_blocks * self.block_bytes

    def stats(self) -> TierStats:
        with self._mutex:
            return replace(self._stats)

    def close(self) -> None:
        """Free the buffers; the tier stores nothing afterwards. Idempotent."""
        with self._mutex:
            self._closed = True
            self._entries.clear()

    def __enter__(self) -> HostTier:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        pinned = ", pinned" if self.pin else ""
        return f"HostTier({len(self)}/{self.capacity_blocks} blocks{pinned})"
