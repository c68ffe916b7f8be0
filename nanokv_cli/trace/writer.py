"""Writing a version-2 trace: an event listener that holds a run's events until a step
boundary, then writes them as one record (with the prompts they introduce), and every
``CHECKPOINT_EVERY`` steps the cache state after them."""

from __future__ import annotations

import time
from pathlib import Path
from typing import IO, Any

import msgpack
import numpy as np
import zstandard

from ..engine.core.events import (
    BlockAllocated,
    BlockFreed,
    BlockHit,
    BlockRemoved,
    BlockStored,
    CacheState,
    Event,
    SequenceAdded,
    StepSnapshot,
)
from ..paths import open_output
from .format import (
    _ADDED,
    _ALLOCATED,
    _CODE,
    _FIELDS,
    _FREED,
    _HIT,
    _PREFIX,
    _REMOVED,
    _SNAPSHOT,
    _STORED,
    CHECKPOINT_EVERY,
    FLUSH_EVENTS,
    FLUSH_SECONDS,
    FLUSH_STEPS,
    MAGIC,
    _token_bytes,
)


class TraceWriter:
    """An event listener that writes a version-2 trace.

    Events are held until a step boundary, then written as one record (with the prompts they
    introduce); every ``CHECKPOINT_EVERY`` steps the cache state follows as a checkpoint.
    """

    def __init__(self, path: str | Path, header: dict[str, Any]) -> None:
        self.path = Path(path)
        self.block_size = header["block_size"]
        # Never through a symlink or into a FIFO or device (paths.open_output says why).
        self._file: IO[bytes] | None = open_output(self.path, "--record", binary=True)
        self._zstd = zstandard.ZstdCompressor(level=3, write_checksum=True)
        self._file.write(MAGIC)
        self._record(b"H", 0, 0, header)
        self._file.flush()
        self._events: list[Event] = []
        self._interrupted = False
        self._steps = 0  # step boundaries held
        self._first_step = 0
        self._last_flush = time.monotonic()
        self._last_checkpoint = -1
        # The cache's books (block tables, prompts, which blocks hold tokens), applied event by
        # event as each is encoded, since the encoding of the next one reads them; checkpoints
        # are written from them.
        self._state = CacheState(header["num_blocks"])
        self._apply = self._state.listener()
        # What only the encoding knows: the (sequence, table index) each block was allocated
        # as, and where each stored block's tokens come from (read for the blocks the state
        # holds tokens of).
        self._owner: dict[int, tuple[int, int]] = {}
        self._source: dict[int, tuple[int, int] | bytes] = {}

    def __call__(self, event: Event) -> None:
        self._events.append(event)
        if type(event) is StepSnapshot:
            self._steps += 1
            if (
                self._steps >= FLUSH_STEPS
                or len(self._events) >= FLUSH_EVENTS
                or time.monotonic() - self._last_flush >= FLUSH_SECONDS
            ):
                self.flush()

    def _record(self, kind: bytes, first: int, last: int, obj: Any) -> None:
        payload = self._zstd.compress(msgpack.packb(obj, use_bin_type=True))
        self._file.write(_PREFIX.pack(len(payload), kind, first, last) + payload)

    def flush(self) -> None:
        """Write the events of every whole step held (those after the last boundary wait).

        A flush cut short (Ctrl-C lands inside it) may have left half a record and half-updated
        books, so the writer then writes nothing more: the file reads up to its last whole
        record, and the reader drops the torn one."""
        if self._file is None or not self._steps or self._interrupted:
            return
        self._interrupted = True  # until this flush has written everything
        events = self._events
        cut = len(events)
        while type(events[cut - 1]) is not StepSnapshot:
            cut -= 1
        done, self._events = events[:cut], events[cut:]
        prompts, encoded = self._encode(done)
        last_step = done[-1].step
        if prompts:
            self._record(b"P", prompts[0][0], prompts[-1][0], prompts)
        self._record(b"E", self._first_step, last_step, encoded)
        if last_step - self._last_checkpoint >= CHECKPOINT_EVERY:
            self._record(b"C", last_step, last_step, self._checkpoint(done[-1]))
            self._last_checkpoint = last_step
        self._file.flush()
        self._first_step = last_step + 1
        self._steps = 0
        self._last_flush = time.monotonic()
        self._interrupted = False

    def _encode(self, events: list[Event]) -> tuple[list, list]:
        """The prompts ``events`` introduce and the events as the format's lists, each
        applied to the books once encoded."""
        bs = self.block_size
        apply, owner, source = self._apply, self._owner, self._source
        tables, prompt_of = self._state.block_tables, self._state.prompts
        prompts = []
        out = []
        append = out.append
        for e in events:
            apply(e)
            t = type(e)
            if t is BlockAllocated:
                owner[e.block_id] = (e.seq_id, len(tables[e.seq_id]) - 1)
                append((_ALLOCATED, e.seq_id, e.block_id))
            elif t is BlockFreed:
                append((_FREED, e.seq_id, e.block_id, e.ref_count))
            elif t is BlockStored:
                seq_id, i = owner.get(e.block_id, (-1, -1))
                if seq_id != -1 and (i + 1) * bs <= len(prompt_of.get(seq_id, ())):
                    source[e.block_id] = (seq_id, i)
                    append((_STORED, e.block_id, e.block_hash, e.parent_hash, seq_id, i))
                else:  # generated tokens: stored here, once
                    data = _token_bytes(e.token_ids)
                    source[e.block_id] = data
                    append((_STORED, e.block_id, e.block_hash, e.parent_hash, -1, data))
            elif t is BlockHit:
                append((_HIT, e.seq_id, e.block_id, e.block_hash, e.kind))
            elif t is BlockRemoved:
                append((_REMOVED, e.block_id, e.block_hash))
            elif t is StepSnapshot:
                append((_SNAPSHOT, *[getattr(e, f) for f in _FIELDS[StepSnapshot]]))
            elif t is SequenceAdded:
                recipe = e.prompt_recipe
                prompts.append(
                    (e.seq_id, recipe if recipe is not None else _token_bytes(e.prompt_token_ids))
                )
                append((_ADDED, e.seq_id, e.max_tokens, e.arrival_time))
            else:
                append((_CODE[t], *[getattr(e, f) for f in _FIELDS[t]]))
        return prompts, out

    def _checkpoint(self, snapshot: StepSnapshot) -> dict[str, Any]:
        st = self._state
        # The sources of the blocks that hold tokens now; the rest (reused or evicted since
        # they were stored) are dropped here.
        self._source = {b: self._source[b] for b in st.block_tokens}
        sources = []
        for b, src in self._source.items():
            if isinstance(src, tuple):
                sources.append((b, src[0], src[1]))
            else:
                sources.append((b, -1, src))
        return {
            "ref_count": np.asarray(st.ref_count, dtype="<i4").tobytes(),
            "block_hash": st.block_hash,
            "tables": list(st.block_tables.items()),
            "sources": sources,
            "unfinished": list(st.prompts),
            "snapshot": [getattr(snapshot, f) for f in _FIELDS[StepSnapshot]],
        }

    def close(self) -> None:
        if self._file is not None:
            self.flush()
            self._file.close()
            self._file = None

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
