"""A KV tier in a file: blocks evicted from the device cache, kept across restarts.

The file (format in layout.py) is an array of fixed-size slots behind a header page; it grows
a slot at a time as blocks arrive and never past ``size_bytes``. Its index (hash -> slot,
tokens, LRU order) lives in memory and is rebuilt on open by reading each slot's small entry
header, so a process restarted on the same directory finds the blocks stored before. Each
fingerprint has a file of its own in the directory, so models can share one directory.

One process owns a file at a time: an exclusive ``flock`` on ``<file>.lock``, which holds
the owner's PID for the refusal message. Methods are thread-safe (one lock around the file).

Nothing is fsynced: a cache need not survive a power cut, only never serve damaged data, and
the checksums see to that (a block lost to a crash is a miss).
"""

from __future__ import annotations

import errno
import heapq
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import replace

import torch

from .base import (
    TierStats,
    TierUnavailable,
    block_hash_of,
    block_tokens,
    check_block_tensor,
)
from .buffers import byte_runs, read_all, staging_like, write_all
from .fingerprint import Fingerprint
from .layout import (
    FILE_HEADER_BYTES,
    Entry,
    entry_bytes,
    file_header,
    file_name,
    header_problem,
    pack_entry,
    pack_tick,
    payload_checksum,
    slot_size,
    tick_offset,
    unpack_entry,
)
from .spec import format_size

try:
    import fcntl
except ImportError:  # not POSIX: no flock, so no safe sharing of the file
    fcntl = None

_ZERO_MAGIC = b"\0\0\0\0"


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc)


def _lock(directory: str, lock_path: str) -> int:
    """An open, exclusively locked lock file holding this process's PID; TierUnavailable
    when the directory is unusable or another process holds the lock."""
    if fcntl is None:
        raise TierUnavailable("the KV disk tier needs POSIX file locks (fcntl), absent here")
    try:
        os.makedirs(directory, exist_ok=True)
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise TierUnavailable(
            f"cannot use {directory} for the KV disk tier: {_reason(exc)}"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
        os.close(fd)
        raise TierUnavailable(
            f"KV disk tier {lock_path.removesuffix('.lock')} is in use by process {holder}; "
            "refused (one process per tier file: give this one another directory)"
        ) from None
    except OSError as exc:  # e.g. a file system without locks
        os.close(fd)
        raise TierUnavailable(f"cannot lock {lock_path}: {_reason(exc)}") from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError as exc:
        os.close(fd)
        raise TierUnavailable(f"cannot write {lock_path}: {_reason(exc)}") from None
    return fd


class DiskTier:
    """Blocks in ``<path>/<fingerprint digest>.kvtier``, at most ``size_bytes`` of file.

    Opening raises TierUnavailable (path, reason) when the directory cannot be created or
    written, the disk has no room for one block, ``size_bytes`` holds no block, or another
    process has the file. After that nothing raises for file trouble: a damaged, truncated or
    foreign file reads as misses; a failed write disables the tier (``stats().disabled``
    says why) and store returns False. Wrong shapes, dtypes or token counts raise ValueError:
    those are the caller's bugs, not the file's.
    """

    medium = "disk"

    def __init__(self, path: str | os.PathLike, size_bytes: int, fingerprint: Fingerprint):
        if isinstance(size_bytes, bool) or not isinstance(size_bytes, int) or size_bytes <= 0:
            raise ValueError(f"size_bytes must be a positive int, got {size_bytes!r}")
        self.fingerprint = fingerprint
        self.directory = os.path.abspath(os.path.expanduser(os.fspath(path)))
        self.data_path = os.path.join(self.directory, file_name(fingerprint))
        self.size_bytes = size_bytes
        self.block_bytes = fingerprint.block_bytes
        self.slot_size = slot_size(fingerprint)
        self.num_slots = (size_bytes - FILE_HEADER_BYTES) // self.slot_size
        if self.num_slots < 1:
            raise TierUnavailable(
                f"KV disk tier {self.directory}: {format_size(size_bytes)} holds no block "
                f"(one takes {FILE_HEADER_BYTES + self.slot_size} bytes with the file header)"
            )
        self._entry_bytes = entry_bytes(fingerprint.block_size)
        self._stats = TierStats()
        self._mutex = threading.Lock()
        self._index: OrderedDict[int, Entry] = OrderedDict()  # least recently used first
        self._free: list[int] = []  # a heap: the lowest free slot first keeps the file short
        self._tick = 0
        self._file_end = 0  # bytes of the file in use; slots past it were never written
        self._staging: torch.Tensor | None = None
        self._fd = self._lock_fd = -1
        try:
            self._lock_fd = _lock(self.directory, self.data_path + ".lock")
            self._open_file()
        except BaseException:
            self._release()
            raise

    # -- opening ---------------------------------------------------------------------------

    def _open_file(self) -> None:
        """Open the data file and rebuild the index from it, or start it afresh when it is
        not a readable file of this fingerprint."""
        try:
            self._fd = os.open(self.data_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            size = os.fstat(self._fd).st_size
            expected = file_header(self.fingerprint)
            problem = header_problem(os.pread(self._fd, FILE_HEADER_BYTES, 0), expected)
            if size == 0 or problem:
                if size:
                    self._stats.resets += 1
                    self._stats.reset_reason = problem
                os.ftruncate(self._fd, 0)
                write_all(self._fd, [memoryview(expected)], 0)
                size = FILE_HEADER_BYTES
            bound = FILE_HEADER_BYTES + self.num_slots * self.slot_size
            if size > bound:  # opened with a smaller size than last time
                os.ftruncate(self._fd, bound)
                size = bound
            self._file_end = size
            self._scan()
            self._check_space()
        except OSError as exc:
            raise TierUnavailable(
                f"cannot use {self.data_path} as a KV disk tier: {_reason(exc)}"
            ) from None

    def _scan(self) -> None:
        """Index every slot whose entry header is whole and intact; the rest are free."""
        found: dict[int, Entry] = {}
        for slot in range(self.num_slots):
            at = self._header_at(slot)
            if at + self._entry_bytes > self._file_end:
                self._free.append(slot)  # never written, or cut off by truncation
                continue
            data = os.pread(self._fd, self._entry_bytes, at)
            entry = unpack_entry(data, slot, self.fingerprint.block_size)
            if isinstance(entry, str):
                self._stats.corrupt_dropped += entry == "corrupt"
                self._free.append(slot)
                continue
            older = found.get(entry.block_hash)
            if older is not None:  # a hash stored again, its old slot not yet reused
                loser = min(older, entry, key=lambda e: e.tick)
                self._free.append(loser.slot)
                entry = max(older, entry, key=lambda e: e.tick)
            found[entry.block_hash] = entry
        for entry in sorted(found.values(), key=lambda e: e.tick):
            self._index[entry.block_hash] = entry
        self._tick = max((e.tick for e in found.values()), default=0)
        heapq.heapify(self._free)

    def _check_space(self) -> None:
        """TierUnavailable when the file has no slot yet and the disk has no room for one."""
        if self._index or self._file_end > FILE_HEADER_BYTES:
            return
        stat = os.statvfs(self.directory)
        free = stat.f_bavail * stat.f_frsize
        if free < self.slot_size:
            raise TierUnavailable(
                f"no space for the KV disk tier in {self.directory}: {free} bytes free, "
                f"one block needs {self.slot_size}"
            )

    # -- the API ---------------------------------------------------------------------------

    def store(self, block_hash: int, token_ids: Sequence[int], kv: torch.Tensor) -> bool:
        """Keep ``kv`` (one block) under ``block_hash`` and ``token_ids``; False when the tier
        is disabled or closed, or the write failed."""
        block_hash = block_hash_of(block_hash)
        tokens = block_tokens(self.fingerprint, token_ids)
        check_block_tensor(self.fingerprint, kv, "kv")
        with self._mutex:
            if self._fd < 0:
                return False
            held = self._index.get(block_hash)
            if held is not None and held.tokens == tokens:
                self._stats.already_stored += 1
                return self._touch(held)
            if held is not None:  # a colliding hash: the newest content serves it
                del self._index[block_hash]
                heapq.heappush(self._free, held.slot)
            slot = self._take_slot()
            try:
                entry = self._write(slot, block_hash, tokens, kv)
            except BaseException:
                heapq.heappush(self._free, slot)  # Ctrl-C mid-write: the slot is free again
                raise
            if entry is None:
                return False
            self._index[block_hash] = entry
            self._stats.stores += 1
            self._stats.bytes_written += self.block_bytes
            return True

    def load(self, block_hash: int, token_ids: Sequence[int], out: torch.Tensor) -> bool:
        """Copy the block stored under ``block_hash`` into ``out``; True only when the hash,
        the token ids, the fingerprint (this file's) and the checksum all match. On False,
        ``out`` is untouched unless the stored copy failed its checksum (then unspecified)."""
        block_hash = block_hash_of(block_hash)
        tokens = block_tokens(self.fingerprint, token_ids)
        check_block_tensor(self.fingerprint, out, "out")
        with self._mutex:
            self._stats.loads += 1
            entry = self._index.get(block_hash) if self._fd >= 0 else None
            if entry is None or entry.tokens != tokens or not self._read(entry, out):
                self._stats.misses += 1
                return False
            self._stats.hits += 1
            self._stats.bytes_read += self.block_bytes
            self._touch(entry)
            return True

    def entries(self) -> list[tuple[int, bytes]]:
        """What the tier holds, as (hash, token bytes), least recently used first: what a
        restarted engine's books start from."""
        with self._mutex:
            return [(h, entry.tokens) for h, entry in self._index.items()]

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._index

    def __len__(self) -> int:
        return len(self._index)

    @property
    def used_bytes(self) -> int:
        """K/V bytes held (entries times block bytes; the file also holds their headers)."""
        return len(self._index) * self.block_bytes

    @property
    def capacity_bytes(self) -> int:
        """K/V bytes the tier can hold: its slots times block bytes."""
        return self.num_slots * self.block_bytes

    def stats(self) -> TierStats:
        """A snapshot of the counters."""
        with self._mutex:
            return replace(self._stats)

    def close(self) -> None:
        """Release the file and its lock (another process may open it then). Idempotent."""
        with self._mutex:
            self._release()

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __del__(self) -> None:
        # An unclosed tier still lets go of its lock when collected.
        if getattr(self, "_lock_fd", -1) >= 0 or getattr(self, "_fd", -1) >= 0:
            self._release()

    def __repr__(self) -> str:
        return (
            f"DiskTier({self.data_path!r}, {len(self._index)}/{self.num_slots} blocks, "
            f"{format_size(self.size_bytes)})"
        )

    # -- slots -----------------------------------------------------------------------------

    def _slot_at(self, slot: int) -> int:
        return FILE_HEADER_BYTES + slot * self.slot_size

    def _header_at(self, slot: int) -> int:
        return self._slot_at(slot) + self.block_bytes

    def _take_slot(self) -> int:
        """A free slot, evicting the least recently used entry when there is none."""
        if self._free:
            return heapq.heappop(self._free)
        _, victim = self._index.popitem(last=False)
        self._stats.evictions += 1
        return victim.slot

    def _write(self, slot: int, block_hash: int, tokens: bytes, kv: torch.Tensor) -> Entry | None:
        """Write a block into ``slot``: its payload, then its entry header, in one call. None
        when the write failed (the tier is disabled, or capped when the disk filled)."""
        source = kv if kv.device.type == "cpu" else kv.detach().to("cpu")
        runs = byte_runs(source)
        if runs is None:
            source = source.contiguous()
            runs = byte_runs(source)
        self._tick += 1
        entry = Entry(slot, block_hash, tokens, payload_checksum(runs, tokens), self._tick)
        at = self._slot_at(slot)
        try:
            if at < self._file_end:
                # Zero the old header first: a write torn from here on reads as an empty slot.
                os.pwrite(self._fd, _ZERO_MAGIC, self._header_at(slot))
            write_all(self._fd, [*runs, memoryview(pack_entry(entry))], at)
        except OSError as exc:
            self._write_failed(slot, exc)
            return None
        self._file_end = max(self._file_end, at + self.block_bytes + self._entry_bytes)
        return entry

    def _write_failed(self, slot: int, exc: OSError) -> None:
        """A full disk caps the tier at the slots already in the file; any other write
        error disables it."""
        self._stats.errors += 1
        at = self._slot_at(slot)
        if exc.errno == errno.ENOSPC and at >= self._file_end and slot > 0:
            try:
                os.ftruncate(self._fd, self._file_end)  # drop the partial slot
            except OSError as again:
                self._disable(f"write to {self.data_path} failed: {_reason(again)}")
                return
            self.num_slots = slot
            self._free = [s for s in self._free if s < slot]
            heapq.heapify(self._free)
            self._stats.note = (
                f"disk full: KV disk tier {self.data_path} capped at {slot} blocks "
                f"({format_size(slot * self.block_bytes)})"
            )
            return
        self._disable(f"write to {self.data_path} failed: {_reason(exc)}")

    def _read(self, entry: Entry, out: torch.Tensor) -> bool:
        """Fill ``out`` from ``entry``'s slot; False (the entry dropped) when the slot does
        not hold exactly what the index says, intact."""
        runs = byte_runs(out) if out.device.type == "cpu" else None
        staging = None
        if runs is None:
            if self._staging is None:
                self._staging = staging_like(out.shape, out.dtype, pin=out.device.type == "cuda")
            staging = self._staging
            runs = byte_runs(staging)
        header = bytearray(self._entry_bytes)
        try:
            whole = read_all(self._fd, [*runs, memoryview(header)], self._slot_at(entry.slot))
        except OSError as exc:
            self._stats.errors += 1
            self._disable(f"read from {self.data_path} failed: {_reason(exc)}")
            return False
        found = unpack_entry(bytes(header), entry.slot, self.fingerprint.block_size)
        intact = (
            whole
            and isinstance(found, Entry)
            and (found.block_hash, found.tokens, found.checksum)
            == (entry.block_hash, entry.tokens, entry.checksum)
            and payload_checksum(runs, entry.tokens) == entry.checksum
        )
        if not intact:
            self._drop_corrupt(entry)
            return False
        if staging is not None:
            out.copy_(staging)
        return True

    def _drop_corrupt(self, entry: Entry) -> None:
        self._stats.corrupt_dropped += 1
        del self._index[entry.block_hash]
        heapq.heappush(self._free, entry.slot)
        try:  # so the next open does not count it again; the slot is reused either way
            os.pwrite(self._fd, _ZERO_MAGIC, self._header_at(entry.slot))
        except OSError:
            pass

    def _touch(self, entry: Entry) -> bool:
        """Mark ``entry`` most recently used, in memory and in its header (so the LRU order
        survives a restart). False when that write fails (the tier is disabled)."""
        self._tick += 1
        entry.tick = self._tick
        self._index.move_to_end(entry.block_hash)
        at = self._header_at(entry.slot) + tick_offset(self.fingerprint.block_size)
        try:
            os.pwrite(self._fd, pack_tick(self._tick), at)
        except OSError as exc:
            self._stats.errors += 1
            self._disable(f"write to {self.data_path} failed: {_reason(exc)}")
            return False
        return True

    def _disable(self, reason: str) -> None:
        """Stop serving for good, keeping the first reason (the one worth reporting)."""
        if self._stats.disabled is None:
            self._stats.disabled = reason
        self._release()

    def _release(self) -> None:
        self._index.clear()
        self._free.clear()
        for name in ("_fd", "_lock_fd"):
            fd = getattr(self, name, -1)
            if fd >= 0:
                setattr(self, name, -1)
                os.close(fd)  # closing the lock file's descriptor releases the flock
