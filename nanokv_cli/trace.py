"""Event traces: every engine event of a run, compact and seekable, for ``nanokv inspect``.

Version 2 layout. The file opens with the 8 bytes ``NKVTRC02``; then come records, each a
21-byte prefix (``<IcQQ``: payload length, kind, first, last) and a payload that is one zstd
frame (zstandard, content checksum on) of one msgpack object. Kinds:

* ``H`` the header dict (the first record).
* ``P`` prompts of sequences ``first..last``: ``[[seq_id, tokens], ...]``, tokens as int32
  bytes, or a recipe list where the prompt was synthesized (a Mooncake request's hash ids).
  This is the only place prompt tokens are stored.
* ``E`` the events of steps ``first..last``, each a list ``[code, field, ...]``; a
  ``BlockStored`` of prompt tokens names ``(seq_id, block index)`` instead of its tokens.
* ``C`` a checkpoint: the cache state at the end of step ``first`` (ref counts, hashes, block
  tables, where each cached block's tokens come from, the unfinished sequences, the snapshot).

The prefixes are the index: opening a trace hops from prefix to prefix without reading a
payload, so reading step N decodes the checkpoint before it and at most ``CHECKPOINT_EVERY``
steps of events, plus the prompts those name. Records are written whole, at step boundaries
(at least every ``FLUSH_SECONDS``); a run killed mid-write leaves a torn last record, which
the reader drops with a note. Version 1 traces (JSONL) are still read.
"""

from __future__ import annotations

import ast
import bisect
import json
import math
import os
import stat
import struct
import sys
import time
from array import array
from collections.abc import Callable, Iterator
from dataclasses import fields
from pathlib import Path
from typing import IO, Any

import msgpack
import numpy as np
import zstandard

from . import __version__
from .engine.block_manager import MISS_REASONS
from .engine.events import (
    AllBlocksCleared,
    BlockAllocated,
    BlockCopied,
    BlockFreed,
    BlockHit,
    BlockRemoved,
    BlockStored,
    CacheLookup,
    CacheState,
    Event,
    SequenceAdded,
    SequenceFinished,
    SequencePreempted,
    StepSnapshot,
    event_from_dict,
    event_to_dict,
)
from .engine.mooncake import MAX_LINE_CHARS as MOONCAKE_LINE_CHARS
from .kv_events import export_batches
from .paths import kind_of, open_output
from .report import cache_numbers

TRACE_FORMAT = "nanokv-trace"
TRACE_VERSION = 2
MAGIC = b"NKVTRC02"
CHECKPOINT_EVERY = 256  # steps between checkpoints: the most events reading a step replays
FLUSH_SECONDS = 0.25  # a record is written at the first step boundary after this long...
FLUSH_STEPS = 256  # ...or after this many steps...
FLUSH_EVENTS = 50_000  # ...or this many events, whichever comes first
_PREFIX = struct.Struct("<IcQQ")

# Event type codes of version 2: the order is part of the format.
_CODES = (
    SequenceAdded,
    CacheLookup,
    BlockAllocated,
    BlockHit,
    BlockStored,
    BlockRemoved,
    AllBlocksCleared,
    BlockFreed,
    SequencePreempted,
    SequenceFinished,
    StepSnapshot,
    BlockCopied,  # appended: earlier traces hold none
)
_CODE = {cls: i for i, cls in enumerate(_CODES)}
_FIELDS = {cls: tuple(f.name for f in fields(cls)) for cls in _CODES}
_STORED, _ADDED, _SNAPSHOT = _CODE[BlockStored], _CODE[SequenceAdded], _CODE[StepSnapshot]
_ALLOCATED, _FREED, _HIT, _REMOVED = (
    _CODE[BlockAllocated],
    _CODE[BlockFreed],
    _CODE[BlockHit],
    _CODE[BlockRemoved],
)


class TraceError(ValueError):
    """A file that is not a readable nanokv trace; the message names the file."""


class _MissingPrompt(TraceError):
    """No prompt is recorded under a sequence id (a rejected request's, or damage)."""


# A header may claim any cache size; a reader allocates per block, so bound what it accepts.
MAX_NUM_BLOCKS = 1 << 24
MAX_BLOCK_SIZE = 1 << 20
MAX_HEADER_CHARS = 1 << 20  # a version-1 header line is a few hundred

# Reading has budgets, not hopes: a file can declare anything, so each limit is checked before
# the allocation it guards. Each is far above what a recording holds; the figures are of the
# 12,000-request Mooncake conversation trace (block size 512, 8,000 blocks): 66 MB, 31,031
# steps, 1.1 million events, 145 million prompt tokens.
MAX_HEADER_BYTES = 1 << 16  # a header, decompressed: a written one is about 200 bytes
MAX_HEADER_STRING = 4096  # PATH_MAX: the longest model or source path a header names
MAX_RECORD_BYTES = 1 << 28  # any other record, decompressed: that trace's largest is 0.8 MB
# A record ends at the first step boundary after FLUSH_EVENTS; one step adds at most the
# blocks its token budget fills and those its finished sequences free (that trace's largest
# record holds 10,628 events).
MAX_RECORD_EVENTS = 1 << 20
# A Mooncake line is at most MOONCAKE_LINE_CHARS, so it names at most half as many hash ids.
MAX_HASH_IDS = MOONCAKE_LINE_CHARS // 2
# Tokens of one prompt, past any model's context (128 MiB as int64); a prompt also fits the
# header's cache, as the scheduler refuses one that does not before it is recorded.
MAX_PROMPT_TOKENS = 1 << 24
# What one view (a step, the summary, a request, an export) may decode: 60 times that trace.
MAX_VIEW_EVENTS = 1 << 26
MAX_VIEW_PROMPT_TOKENS = 1 << 33
_KIND_NAMES = {b"H": "header", b"P": "prompts", b"E": "events", b"C": "checkpoint"}
_DECODE_ERRORS = (zstandard.ZstdError, msgpack.UnpackException, ValueError, TypeError)


class _OverLimit(ValueError):
    """A record that asks for more than a reading budget allows (the message says which)."""


def _check_header(path: Path, h: Any, version: int) -> str | None:
    """Refuse a header whose cache a reader cannot build; returns a note when its ``model``
    cannot name a tokenizer (that only costs the block text, so the trace still opens)."""
    where = f"{path} line 1" if version == 1 else str(path)
    for key, top in (("block_size", MAX_BLOCK_SIZE), ("num_blocks", MAX_NUM_BLOCKS)):
        v = h.get(key)
        if type(v) is not int or not 1 <= v <= top:
            raise TraceError(f"{where}: header lacks a valid {key!r} (1 to {top:,})")
    if "model" not in h:
        h["model"] = None
        return "the trace's header names no model"
    model = h["model"]
    if model is not None and (not isinstance(model, str) or not model):
        h["model"] = None  # views show the header's model as a path
        return f"the trace's header names no model path (its model is {_short(model)})"
    return None


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _reason(e: BaseException) -> str:
    """What went wrong, for inside a message's parentheses: never empty (msgpack's StackError
    has no text), with the exception's type where its text alone would not say it."""
    text = " ".join(str(e).split())
    text = text if len(text) <= 200 else text[:197] + "..."
    if type(e) in (ValueError, TraceError, _OverLimit) and text:
        return text
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _check_event(event: Event, num_blocks: int) -> None:
    """Refuse fields that would corrupt a rebuilt state (a negative block id would alias
    another block through Python's negative indexing) or break what reads it (a count that
    is a string, a miss reason no view knows)."""
    for name in ("block_id", "seq_id", "ref_count"):
        v = getattr(event, name, 0)
        if type(v) is not int or v < 0 or (name == "block_id" and v >= num_blocks):
            raise ValueError(f"{type(event).__name__}.{name} = {_short(v)} is out of range")
    for name, ok in _FIELD_CHECKS[type(event)]:
        v = getattr(event, name)
        if not ok(v):
            raise ValueError(f"{type(event).__name__}.{name} = {_short(v)} is not valid")


def _is_number(v: object) -> bool:
    return type(v) in (int, float) and math.isfinite(v)


def _is_schedule(v: object) -> bool:
    return isinstance(v, list) and all(
        len(x) == 2 and type(x[0]) is int and type(x[1]) is int for x in v
    )


def _is_miss_tokens(v: object) -> bool:
    return isinstance(v, dict) and all(type(n) is int for n in v.values())


def _field_checks(cls: type) -> tuple[tuple[str, Callable[[Any], bool]], ...]:
    """A type test for each field of ``cls`` that a reader computes with or looks up,
    from its annotation (a string: events.py defers them)."""
    checks: list[tuple[str, Callable[[Any], bool]]] = []
    for f in fields(cls):
        if f.name in ("block_id", "seq_id", "ref_count"):
            continue  # checked with their ranges
        if f.name in ("block_hash", "parent_hash"):
            continue  # only compared and shown; the most frequent fields, so left unchecked
        if f.name == "reason" and cls is CacheLookup:
            checks.append((f.name, MISS_REASONS.__contains__))
        elif f.type == "int":
            checks.append((f.name, lambda v: type(v) is int))
        elif f.type == "float":
            checks.append((f.name, _is_number))
        elif f.type == "bool":
            checks.append((f.name, lambda v: type(v) is bool))
        elif f.type.startswith("Literal["):
            allowed = frozenset(ast.literal_eval(f.type[len("Literal") :]))
            checks.append((f.name, lambda v, allowed=allowed: type(v) is str and v in allowed))
        elif f.type == "list[tuple[int, int]]":
            checks.append((f.name, _is_schedule))
        elif f.type == "dict[str, int]":
            checks.append((f.name, _is_miss_tokens))
    return tuple(checks)


_FIELD_CHECKS = {cls: _field_checks(cls) for cls in _CODES}


def make_header(
    *, block_size: int, num_blocks: int, model: str | None, **extra: Any
) -> dict[str, Any]:
    return {
        "format": TRACE_FORMAT,
        "version": TRACE_VERSION,
        "nanokv_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "block_size": block_size,
        "num_blocks": num_blocks,
        "model": model,
        "created_unix": time.time(),  # what exported vLLM event batches' ``ts`` count from
        **extra,
    }


def _token_bytes(tokens) -> bytes:
    return np.asarray(tokens, dtype="<i4").tobytes()


def _tokens(data: bytes) -> array:
    tokens = array("i", data)  # the format's int32 is little-endian; so is every x86 and Arm
    if sys.byteorder != "little":
        tokens.byteswap()
    return tokens


# -- writing -----------------------------------------------------------------------------------


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
        # What checkpoints need, kept up to date as records are written.
        self._state = CacheState(header["num_blocks"])
        self._table_len: dict[int, int] = {}  # seq_id -> blocks in its table
        self._owner: dict[int, tuple[int, int]] = {}  # block -> (seq_id, index) that got it
        self._prompt_len: dict[int, int] = {}  # unfinished seq_id -> prompt tokens
        self._source: dict[int, tuple[int, int] | bytes] = {}  # cached block -> its tokens' origin
        self._recipes: dict[int, list] = {}

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
        self._state.apply_all(done)
        if last_step - self._last_checkpoint >= CHECKPOINT_EVERY:
            self._record(b"C", last_step, last_step, self._checkpoint(done[-1]))
            self._last_checkpoint = last_step
        self._file.flush()
        self._first_step = last_step + 1
        self._steps = 0
        self._last_flush = time.monotonic()
        self._interrupted = False

    def _encode(self, events: list[Event]) -> tuple[list, list]:
        bs = self.block_size
        table_len, owner, prompt_len, source = (
            self._table_len,
            self._owner,
            self._prompt_len,
            self._source,
        )
        prompts = []
        out = []
        append = out.append
        for e in events:
            t = type(e)
            if t is BlockAllocated:
                i = table_len.get(e.seq_id, 0)
                table_len[e.seq_id] = i + 1
                owner[e.block_id] = (e.seq_id, i)
                source.pop(e.block_id, None)
                append((_ALLOCATED, e.seq_id, e.block_id))
            elif t is BlockFreed:
                table_len[e.seq_id] -= 1
                append((_FREED, e.seq_id, e.block_id, e.ref_count))
            elif t is BlockStored:
                seq_id, i = owner.get(e.block_id, (-1, -1))
                if seq_id != -1 and (i + 1) * bs <= prompt_len.get(seq_id, 0):
                    source[e.block_id] = (seq_id, i)
                    append((_STORED, e.block_id, e.block_hash, e.parent_hash, seq_id, i))
                else:  # generated tokens: stored here, once
                    data = _token_bytes(e.token_ids)
                    source[e.block_id] = data
                    append((_STORED, e.block_id, e.block_hash, e.parent_hash, -1, data))
            elif t is BlockHit:
                table_len[e.seq_id] = table_len.get(e.seq_id, 0) + 1
                append((_HIT, e.seq_id, e.block_id, e.block_hash, e.kind))
            elif t is BlockRemoved:
                source.pop(e.block_id, None)
                append((_REMOVED, e.block_id, e.block_hash))
            elif t is StepSnapshot:
                append((_SNAPSHOT, *[getattr(e, f) for f in _FIELDS[StepSnapshot]]))
            elif t is SequenceAdded:
                prompt_len[e.seq_id] = len(e.prompt_token_ids)
                recipe = e.prompt_recipe
                prompts.append(
                    (e.seq_id, recipe if recipe is not None else _token_bytes(e.prompt_token_ids))
                )
                if recipe is not None:
                    self._recipes[e.seq_id] = recipe
                append((_ADDED, e.seq_id, e.max_tokens, e.arrival_time))
            else:
                if t is SequenceFinished:
                    prompt_len.pop(e.seq_id, None)
                    table_len.pop(e.seq_id, None)
                elif t is AllBlocksCleared:
                    source.clear()
                append((_CODE[t], *[getattr(e, f) for f in _FIELDS[t]]))
        return prompts, out

    def _checkpoint(self, snapshot: StepSnapshot) -> dict[str, Any]:
        st = self._state
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
            "unfinished": list(self._prompt_len),
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


# -- reading -----------------------------------------------------------------------------------


def _decode(item: list, prompt_of: Callable[[int], Any] | None, bs: int, slice_of) -> Event:
    """An event from its encoded list; without ``prompt_of``, token ids are left empty."""
    if type(item) is not list or not item:
        raise ValueError(f"event {_short(item)} is not a list")
    code = item[0]
    if type(code) is not int or not 0 <= code < len(_CODES):
        raise ValueError(f"unknown event code {_short(code)}")
    cls = _CODES[code]
    if code == _STORED:
        _, b, h, parent, seq_id, ref = item
        if seq_id == -1 and (type(ref) is not bytes or len(ref) != 4 * bs):
            raise ValueError(f"BlockStored tokens {_short(ref)} are not one block's")
        if prompt_of is None:
            tokens = []
        elif seq_id == -1:
            tokens = _tokens(ref)
        else:
            if type(ref) is not int:
                raise ValueError(f"BlockStored block index {_short(ref)} is not valid")
            tokens = slice_of(seq_id, ref * bs, (ref + 1) * bs)
        return BlockStored(b, h, parent, tokens)
    if code == _ADDED:
        _, seq_id, max_tokens, arrival = item
        prompt, recipe = prompt_of(seq_id) if prompt_of is not None else ([], None)
        return SequenceAdded(seq_id, prompt, max_tokens, arrival, recipe)
    if code == _SNAPSHOT:
        snap = StepSnapshot(*item[1:])
        snap.scheduled = [tuple(x) for x in snap.scheduled]
        return snap
    return cls(*item[1:])


def _span(steps: list[int]) -> str:
    if len(steps) > 4:
        return f"{', '.join(f'{s:,}' for s in steps[:3])}, ... {steps[-1]:,}"
    return ", ".join(f"{s:,}" for s in steps)


def _array_len(raw: bytes) -> int:
    """The length of the msgpack array ``raw`` opens with, or -1: read before unpacking, so an
    oversized record is refused without being built."""
    c = raw[0] if raw else 0
    if 0x90 <= c <= 0x9F:
        return c & 0x0F
    if c == 0xDC and len(raw) >= 3:
        return struct.unpack_from(">H", raw, 1)[0]
    if c == 0xDD and len(raw) >= 5:
        return struct.unpack_from(">I", raw, 1)[0]
    return -1


def _decompress(data: bytes, cap: int) -> bytes:
    """One zstd frame, refused before its output is allocated when it declares more than
    ``cap`` bytes (or, declaring nothing, makes more)."""
    size = zstandard.frame_content_size(data)
    if size > cap:
        raise _OverLimit(f"declares {size:,} bytes decompressed; the limit is {cap:,}")
    if size >= 0:  # zstd checks that the frame makes exactly what it declares
        return zstandard.ZstdDecompressor().decompress(data)
    raw = zstandard.ZstdDecompressor().stream_reader(data).read(cap + 1)
    if len(raw) > cap:
        raise _OverLimit(f"makes over {cap:,} bytes decompressed; the limit is {cap:,}")
    return raw


def _frame_end(f: IO[bytes], start: int, end: int, cap: int) -> int | None:
    """Where the zstd frame at ``start`` ends, if before ``end``; None if the file ends inside
    it (a torn write). Fed in small pieces, so no piece makes more than a few MB."""
    d = zstandard.ZstdDecompressor().decompressobj()
    made = 0
    f.seek(start)
    at = start
    while at < end:
        chunk = f.read(min(1 << 16, end - at))
        if not chunk:
            return None
        for i in range(0, len(chunk), 256):
            piece = chunk[i : i + 256]
            made += len(d.decompress(piece))
            if d.eof:
                return at + i + len(piece) - len(d.unused_data)
            if made > cap:
                raise _OverLimit(f"makes over {cap:,} bytes decompressed; the limit is {cap:,}")
        at += len(chunk)
    return None


class TraceReader:
    """Reads a trace's header at once, and any step through the nearest checkpoint."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise TraceError(f"{self.path}: no such file")
        if not self.path.is_file():
            raise TraceError(f"{self.path}: not a regular file")
        try:
            with open(self.path, "rb") as f:
                magic = f.read(len(MAGIC))
        except OSError as e:
            raise TraceError(f"{self.path}: {e.strerror}") from None
        self.note: str | None = None  # set when a torn last record was dropped
        self.header: dict[str, Any] | None = None  # read once the scan has found it
        self._new_view()
        if magic == MAGIC:
            self._v1 = None
            self._scan()
        elif magic[:1] == b"{":
            self._v1 = _JsonlTrace(self.path)
            self.header = self._v1.header
            self._model_note = self._v1.model_note
        else:
            raise TraceError(
                f"{self.path}: not a nanokv trace (write one with `nanokv replay ... --record FILE`)"
            )

    # -- the index ---------------------------------------------------------------------------

    def _scan(self) -> None:
        self.records: list[tuple[bytes, int, int, int, int]] = []  # kind, first, last, at, size
        size = self.path.stat().st_size
        torn = "the last record is torn (the run was cut short); it was left out"
        with open(self.path, "rb") as f:
            at = len(MAGIC)
            while at < size:
                f.seek(at)
                prefix = f.read(_PREFIX.size)
                if len(prefix) < _PREFIX.size:
                    self.note = torn
                    break
                n, kind, first, last = _PREFIX.unpack(prefix)
                if kind not in b"HPEC":
                    if self.records:
                        raise TraceError(
                            f"{self.path}: damaged record at byte {at} (kind {kind!r})"
                        )
                    self.note = torn
                    break
                if at + _PREFIX.size + n > size:
                    self._check_torn(f, at, kind, n, size)
                    self.note = torn
                    break
                self.records.append((kind, first, last, at + _PREFIX.size, n))
                at += _PREFIX.size + n
        if not self.records or self.records[0][0] != b"H":
            raise TraceError(f"{self.path}: the trace has no header record")
        self.header = self._payload(self.records[0])
        self._check_header()
        self._prompt_limit = min(MAX_PROMPT_TOKENS, self.num_blocks * self.block_size)
        self._prompt_cache: dict[int, dict[int, Any]] = {}
        self._check_order()
        self._prompt_records = [r for r in self.records if r[0] == b"P"]
        self._prompt_firsts = [r[1] for r in self._prompt_records]

    def _check_torn(self, f: IO[bytes], at: int, kind: bytes, n: int, size: int) -> None:
        """A record whose length runs past the end of the file is torn only if the file ends
        inside its payload; one whose payload ends before that has a damaged length."""
        start = at + _PREFIX.size
        try:
            end = _frame_end(f, start, size, self._cap(kind))
        except _OverLimit as e:
            where = f"{self.path}: the {_KIND_NAMES[kind]} record at byte {at}"
            raise TraceError(f"{where} {e}") from None
        except _DECODE_ERRORS as e:
            raise TraceError(f"{self.path}: damaged record at byte {at} ({_reason(e)})") from None
        if end is not None:
            raise TraceError(
                f"{self.path}: damaged record at byte {at} (its length says {n:,} bytes, "
                f"but its payload is {end - start:,} and the file goes on)"
            )

    def _check_order(self) -> None:
        """Record prefixes checked against each other, as the writer writes them: one header,
        then per flush the prompts it introduces, the events of the steps after the last
        record's (none repeated or skipped), and a checkpoint of the last of those steps."""
        step = 0  # the first step the next events record must hold
        seq_id = -1  # the last sequence a prompt record holds
        for i, (kind, first, last, at, _) in enumerate(self.records):
            where = f"{self.path}: the {_KIND_NAMES[kind]} record at byte {at - _PREFIX.size}"
            after = self.records[i - 1] if i else None
            if kind == b"H" and (i or first or last):
                raise TraceError(f"{where} is a second header (a record repeated or damaged)")
            if kind == b"E":
                if first != step or not first <= last < first + MAX_RECORD_EVENTS:
                    raise TraceError(
                        f"{where} holds steps {first:,} to {last:,}, but the records before it "
                        f"end at step {step - 1:,} (a record repeated, out of order or damaged)"
                    )
                step = last + 1
            elif kind == b"P":
                if not seq_id < first <= last:
                    raise TraceError(
                        f"{where} holds sequences {first:,} to {last:,}, but the records before "
                        f"it reach sequence {seq_id:,} (a record repeated, out of order or damaged)"
                    )
                seq_id = last
                following = self.records[i + 1][0] if i + 1 < len(self.records) else None
                if following not in (b"E", None):
                    raise TraceError(f"{where} is not followed by the events that use it")
            elif kind == b"C" and (
                after is None or after[0] != b"E" or not first == last == after[2]
            ):
                raise TraceError(f"{where} (step {first:,}) does not follow the events of its step")
        if self.records[-1][0] == b"P":
            # Cut short between a prompt record and its events: checked, then left out.
            self._prompt_entries(self.records.pop())
            self.note = self.note or (
                "the last record holds prompts of steps never recorded (the run was cut short); "
                "it was left out"
            )

    def _cap(self, kind: bytes) -> int:
        """The most bytes a record of ``kind`` may decompress to."""
        if kind == b"H":
            return MAX_HEADER_BYTES
        if kind == b"C":  # a ref count, hash, table entry and source fit in 64 bytes a block
            # While the scan runs (telling a torn end from a damaged length) there is no
            # header yet: the largest cache a header may declare bounds it.
            blocks = self.num_blocks if self.header is not None else MAX_NUM_BLOCKS
            return MAX_RECORD_BYTES + 64 * blocks
        return MAX_RECORD_BYTES

    def _limits(self, kind: bytes) -> dict[str, int]:
        """msgpack's limits for a record of ``kind``, checked before each list, map, string or
        byte string is built: no list longer than the record can hold, no token bytes longer
        than a block (events) or a prompt (prompts) or the cache (checkpoints)."""
        if kind == b"H":
            strings, arrays = MAX_HEADER_STRING, 1024
            return {
                "max_str_len": strings,
                "max_bin_len": strings,
                "max_array_len": arrays,
                "max_map_len": arrays,
                "max_ext_len": 0,
            }
        n, bs = self.num_blocks, self.block_size
        if kind == b"C":
            arrays, bins = max(n, MAX_RECORD_EVENTS), 4 * max(n, bs)
        elif kind == b"P":
            arrays, bins = MAX_RECORD_EVENTS, 4 * self._prompt_limit
        else:
            arrays, bins = MAX_RECORD_EVENTS, 4 * bs
        return {
            "max_str_len": 256,
            "max_bin_len": bins,
            "max_array_len": arrays,
            "max_map_len": 256,
            "max_ext_len": 0,
        }

    def _payload(self, record) -> Any:
        kind, _, _, at, n = record
        where = at - _PREFIX.size  # the record's own offset, as the scan names a prefix
        cap = self._cap(kind)
        try:
            if n > cap + (cap >> 7) + 1024:  # zstd grows incompressible data by under 1%
                raise _OverLimit(f"is {n:,} bytes; the limit is {cap:,}")
            with open(self.path, "rb") as f:
                f.seek(at)
                data = f.read(n)
            raw = _decompress(data, cap)
            if kind == b"E":
                self._spend_events(_array_len(raw))
            return msgpack.unpackb(raw, raw=False, strict_map_key=False, **self._limits(kind))
        except _OverLimit as e:
            name = _KIND_NAMES[kind]
            raise TraceError(f"{self.path}: the {name} record at byte {where} {e}") from None
        except _DECODE_ERRORS as e:
            if type(e) is ValueError and " exceeds max_" in str(e):  # one of msgpack's limits
                name = _KIND_NAMES[kind]
                raise TraceError(
                    f"{self.path}: the {name} record at byte {where} is over a reading limit "
                    f"({_reason(e)})"
                ) from None
            raise TraceError(
                f"{self.path}: damaged record at byte {where} ({_reason(e)})"
            ) from None

    # -- the budget of a view ----------------------------------------------------------------

    def _new_view(self) -> None:
        self._events_left = MAX_VIEW_EVENTS
        self._tokens_left = MAX_VIEW_PROMPT_TOKENS

    def _spend_events(self, n: int) -> None:
        """Count an events record's events against the view's budget, before it is unpacked."""
        if n > MAX_RECORD_EVENTS:
            raise _OverLimit(f"holds {n:,} events; the limit is {MAX_RECORD_EVENTS:,}")
        if n > self._events_left:
            raise _OverLimit(
                f"is past the {MAX_VIEW_EVENTS:,} events one view may read (the trace holds more)"
            )
        self._events_left -= n

    def _spend_tokens(self, seq_id: int, n: int) -> None:
        if n > self._tokens_left:
            raise TraceError(
                f"{self.path}: the prompt of sequence {seq_id} is past the "
                f"{MAX_VIEW_PROMPT_TOKENS:,} prompt tokens one view may make"
            )
        self._tokens_left -= n

    def _check_header(self) -> None:
        h = self.header
        if not isinstance(h, dict) or h.get("format") != TRACE_FORMAT:
            raise TraceError(f"{self.path}: not a nanokv trace")
        if h.get("version") != TRACE_VERSION:
            raise TraceError(
                f"{self.path}: trace format version {_short(h.get('version'))} is not supported "
                f"(this nanokv reads versions 1 and {TRACE_VERSION})"
            )
        self._model_note = _check_header(self.path, h, TRACE_VERSION)

    def model_path(self) -> tuple[str | None, str | None]:
        """The model the header names, to decode block text with, and None; or None and why
        it cannot be used (the text is then left out). Only a file or a folder is handed on:
        reading a FIFO would block and a device never ends."""
        if self._model_note is not None:
            return None, self._model_note
        model = self.header["model"]
        if model is None:  # a run on token ids only
            return None, None
        try:
            mode = os.stat(Path(model).expanduser()).st_mode
        except (OSError, ValueError) as e:  # ValueError: a NUL in the path
            why = getattr(e, "strerror", None) or str(e)
            return None, f"the trace's model {_short(model)}: {why}"
        if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
            return None, f"the trace's model {_short(model)} is {kind_of(mode)}, not a model"
        return model, None

    @property
    def block_size(self) -> int:
        return self.header["block_size"]

    @property
    def num_blocks(self) -> int:
        return self.header["num_blocks"]

    # -- prompts -----------------------------------------------------------------------------

    def _prompts_of(self, seq_id: int) -> dict[int, Any]:
        # Prompt records come in seq-id order (an engine numbers requests as they arrive).
        if type(seq_id) is not int:
            raise TraceError(f"{self.path}: sequence id {_short(seq_id)} is not valid")
        i = bisect.bisect_right(self._prompt_firsts, seq_id) - 1
        if i >= 0 and seq_id <= self._prompt_records[i][2]:
            rec = self._prompt_records[i]
            got = self._prompt_cache.get(rec[3])
            if got is None:
                got = self._prompt_cache[rec[3]] = self._prompt_entries(rec)
            if seq_id in got:
                return got
        raise _MissingPrompt(f"{self.path}: the prompt of sequence {seq_id} is missing")

    def _prompt_entries(self, rec) -> dict[int, Any]:
        """A prompt record's prompts by sequence id, each checked (tokens within the caps, a
        recipe that makes a prompt), so no reader of them meets a malformed one."""
        _, first, last, at, _ = rec
        items = self._payload(rec)
        where = at - _PREFIX.size
        got: dict[int, Any] = {}
        try:
            if type(items) is not list or not items:
                raise ValueError("not a list of prompts")
            previous = first - 1
            for item in items:
                if type(item) is not list or len(item) != 2:
                    raise ValueError(f"prompt entry {_short(item)} is not [sequence, prompt]")
                seq_id, entry = item
                if type(seq_id) is not int or not previous < seq_id <= last:
                    raise ValueError(f"sequence {_short(seq_id)} is out of order or range")
                got[seq_id] = self._checked_prompt(seq_id, entry)
                previous = seq_id
            if items[0][0] != first or previous != last:
                raise ValueError(f"its prompts are of sequences other than {first} to {last}")
        except _OverLimit as e:
            raise TraceError(f"{self.path}: the prompts record at byte {where}: {e}") from None
        except ValueError as e:
            raise TraceError(
                f"{self.path}: damaged record at byte {where} ({_reason(e)})"
            ) from None
        return got

    def _checked_prompt(self, seq_id: int, entry: Any) -> Any:
        limit = self._prompt_limit
        if type(entry) is bytes:
            if len(entry) % 4:
                raise ValueError(f"the prompt of sequence {seq_id} is not whole int32 tokens")
            n = len(entry) // 4
        else:
            from .engine.mooncake import SynthesizedPrompt

            hash_ids = entry[1] if type(entry) is list and len(entry) == 4 else ()
            if isinstance(hash_ids, list) and len(hash_ids) > MAX_HASH_IDS:
                raise _OverLimit(
                    f"the prompt of sequence {seq_id} names {len(hash_ids):,} hash ids; "
                    f"the limit is {MAX_HASH_IDS:,}"
                )
            n = SynthesizedPrompt.from_recipe(entry).input_length
        if n > limit:
            raise _OverLimit(
                f"the prompt of sequence {seq_id} has {n:,} tokens; the limit is {limit:,} "
                "(the header's cache, or the most any prompt has)"
            )
        return entry

    @staticmethod
    def _prompt_len(entry: Any) -> int:
        return len(entry) // 4 if type(entry) is bytes else entry[2]

    def prompt(self, seq_id: int) -> tuple[array, list | None]:
        """A sequence's prompt tokens (a compact array), and its recipe if it was synthesized."""
        entry = self._prompts_of(seq_id)[seq_id]
        self._spend_tokens(seq_id, self._prompt_len(entry))
        if isinstance(entry, bytes):
            return _tokens(entry), None
        from .engine.mooncake import SynthesizedPrompt

        return SynthesizedPrompt.from_recipe(entry)(), entry

    def _block_of(self, seq_id: int, start: int, end: int) -> Any:
        """The prompt entry a block of tokens ``start..end`` of ``seq_id`` comes from; a block
        past the prompt's end is a damaged reference, not an empty block."""
        entry = self._prompts_of(seq_id)[seq_id]
        if not 0 <= start < end <= self._prompt_len(entry):
            raise ValueError(
                f"tokens {start:,} to {end:,} are past the prompt of sequence {seq_id}"
            )
        return entry

    def prompt_slice(self, seq_id: int, start: int, end: int) -> list[int]:
        entry = self._block_of(seq_id, start, end)
        if isinstance(entry, bytes):
            return _tokens(entry[4 * start : 4 * end])
        from .engine.mooncake import MOONCAKE_BLOCK_SIZE, synthesize_tokens

        _, hash_ids, _, vocab = entry
        lo, hi = start // MOONCAKE_BLOCK_SIZE, -(-end // MOONCAKE_BLOCK_SIZE)
        part = synthesize_tokens(hash_ids[lo:hi], (hi - lo) * MOONCAKE_BLOCK_SIZE, vocab)
        off = lo * MOONCAKE_BLOCK_SIZE
        return part[start - off : end - off]

    def _resolve_sources(self, state: CacheState, sources: list) -> None:
        """Fill ``state.block_tokens`` from a checkpoint's block sources, synthesizing every
        recipe-made block in one batch (a cache can hold thousands of them)."""
        from .engine.mooncake import MOONCAKE_BLOCK_SIZE as M
        from .engine.mooncake import synthesize_tokens

        bs, n = self.block_size, self.num_blocks
        wanted: list[tuple[int, int, int]] = []  # block, start in the batch, its first id
        ids: list[int] = []
        vocab = 32000
        for b, seq_id, ref in sources:
            if type(b) is not int or not 0 <= b < n:
                raise ValueError(f"source block {_short(b)} is out of range")
            if seq_id == -1:
                if type(ref) is not bytes or len(ref) != 4 * bs:
                    raise ValueError(f"the tokens of block {b} are not one block's")
                state.block_tokens[b] = _tokens(ref)
                continue
            if type(ref) is not int:
                raise ValueError(f"block {b} names block index {_short(ref)}")
            start, end = ref * bs, (ref + 1) * bs
            entry = self._block_of(seq_id, start, end)
            if isinstance(entry, bytes):
                state.block_tokens[b] = _tokens(entry[4 * start : 4 * end])
                continue
            lo, hi = start // M, -(-end // M)
            if entry[3] != vocab:  # made with another vocabulary: not part of the batch
                state.block_tokens[b] = self.prompt_slice(seq_id, start, end)
                continue
            wanted.append((b, len(ids) * M + start - lo * M, end - start))
            ids.extend(entry[1][lo:hi])
        if wanted:
            tokens = synthesize_tokens(ids, len(ids) * M, vocab)
            for b, at, n in wanted:
                state.block_tokens[b] = tokens[at : at + n]

    # -- events and states -------------------------------------------------------------------

    def _decoded(self, record, tokens: bool = True) -> list[Event]:
        bs = self.block_size
        items = self._payload(record)
        prompt_of = self.prompt if tokens else None
        n = self.num_blocks
        try:
            if type(items) is not list:
                raise ValueError(f"{_short(items)} is not a list of events")
            events = [_decode(it, prompt_of, bs, self.prompt_slice) for it in items]
            for event in events:
                _check_event(event, n)
        except TraceError:
            raise  # already says what is wrong
        except (TypeError, ValueError, IndexError) as e:
            raise TraceError(
                f"{self.path}: a record does not hold trace events ({_reason(e)})"
            ) from None
        steps = [e.step for e in events if type(e) is StepSnapshot]
        self._check_steps(record, steps, bool(events) and type(events[-1]) is StepSnapshot)
        return events

    def _check_steps(self, record, steps: list[int], ends: bool) -> None:
        """An events record holds whole steps, those its prefix names: a step's events end
        with its snapshot, so the record ends with one, and the snapshots count its steps."""
        _, first, last, at, _ = record
        where = f"{self.path}: the events record at byte {at - _PREFIX.size}"
        if not ends:
            raise TraceError(f"{where} does not end at the end of a step (a step's snapshot)")
        if (
            steps[0] != first
            or steps[-1] != last
            or len(steps) != last - first + 1
            or any(b - a != 1 for a, b in zip(steps, steps[1:]))
        ):
            raise TraceError(
                f"{where} holds steps {_span(steps)}; its prefix says {first:,} to {last:,}"
            )

    def events(self, tokens: bool = True) -> Iterator[Event]:
        """Every event of every whole step, in order. ``tokens=False`` leaves prompts and
        stored blocks' token ids empty, for readers that only follow the books (much faster
        on a long synthesized trace)."""
        if self._v1 is not None:
            yield from self._v1.events()
            return
        self._new_view()
        for rec in self.records:
            if rec[0] == b"E":
                yield from self._decoded(rec, tokens)

    def summary(self) -> dict[str, Any]:
        """Steps, events per type and bytes per record kind, for ``inspect --summary``."""
        counts: dict[str, int] = {}
        last = None
        snapshot = None  # the last step's: it carries the run's cache counters
        if self._v1 is not None:
            for event in self.events():
                name = type(event).__name__
                counts[name] = counts.get(name, 0) + 1
                if type(event) is StepSnapshot:
                    last, snapshot = event.step, event
        else:
            self._new_view()
            codes = [0] * len(_CODES)
            final = None
            for rec in self.records:
                if rec[0] == b"E":
                    self._count_codes(rec, codes)
                    last, final = rec[2], rec
            counts = {cls.__name__: n for cls, n in zip(_CODES, codes) if n}
            if final is not None:
                snapshot = self._last_snapshot(final)

        sizes: dict[str, int] = {}
        for kind, _, _, _, n in getattr(self, "records", []):
            name = {b"H": "header", b"P": "prompts", b"E": "events", b"C": "checkpoints"}[kind]
            sizes[name] = sizes.get(name, 0) + n
        return {
            "version": self.header.get("version"),
            "steps": 0 if last is None else last + 1,
            "events": counts,
            "num_events": sum(counts.values()),
            "file_bytes": self.path.stat().st_size,
            "record_bytes": sizes,
            "checkpoints": sum(1 for r in getattr(self, "records", []) if r[0] == b"C"),
            "requests": self.num_requests(),
            "cache": cache_numbers(snapshot),
        }

    def _last_snapshot(self, record) -> StepSnapshot | None:
        """The last step snapshot of an events record, which carries the run's counters: only
        that event is decoded (the summary reads no other event, and checks none)."""
        items = self._payload(record)
        if type(items) is not list:
            return None
        last = next(
            (it for it in reversed(items) if type(it) is list and it[:1] == [_SNAPSHOT]), None
        )
        if last is None:
            return None
        try:
            return _decode(last, None, self.block_size, self.prompt_slice)
        except (TypeError, ValueError, IndexError) as e:
            at = record[3] - _PREFIX.size
            raise TraceError(f"{self.path}: damaged step snapshot at byte {at} ({e})") from None

    def num_requests(self) -> int | None:
        """Requests the trace holds (ids 0 to n - 1); None for a version 1 trace."""
        if self._v1 is not None:
            return None
        return max((rec[2] + 1 for rec in self.records if rec[0] == b"P"), default=0)

    def _count_codes(self, rec, codes: list[int]) -> None:
        """Add an events record's events per type to ``codes``, without decoding them: only
        their type codes and the snapshots' steps are checked."""
        items = self._payload(rec)
        n = len(_CODES)
        steps = []
        try:
            if type(items) is not list:
                raise ValueError(f"{_short(items)} is not a list of events")
            for item in items:
                if type(item) is not list or not item:
                    raise ValueError(f"event {_short(item)} is not a list")
                code = item[0]
                if type(code) is not int or not 0 <= code < n:
                    raise ValueError(f"unknown event code {_short(code)}")
                codes[code] += 1
                if code == _SNAPSHOT:
                    step = item[1] if len(item) > 1 else None
                    if type(step) is not int:
                        raise ValueError(f"StepSnapshot.step = {_short(step)} is not valid")
                    steps.append(step)
        except ValueError as e:
            raise TraceError(f"{self.path}: a record does not hold trace events ({e})") from None
        self._check_steps(rec, steps, bool(items) and items[-1][0] == _SNAPSHOT)

    def state_at(self, step: int | None = None) -> CacheState:
        """The cache as it stood at the end of ``step`` (default: the last recorded step)."""
        if self._v1 is not None:
            return self._v1.state_at(step)
        self._new_view()
        steps = [r for r in self.records if r[0] == b"E"]
        if not steps:
            raise TraceError(f"{self.path}: the trace holds no steps")
        last = steps[-1][2]
        if step is None:
            step = last
        if step > last:
            raise TraceError(f"{self.path}: no step {step}; the trace has steps up to {last}")
        checkpoint = None
        for rec in self.records:
            if rec[0] == b"C" and rec[1] <= step:
                checkpoint = rec
        state = CacheState(self.num_blocks)
        start = 0
        if checkpoint is not None:
            self._restore(state, checkpoint)
            start = checkpoint[1] + 1
            if start > step:
                return state
        try:
            for rec in steps:
                if rec[2] < start or rec[1] > step:
                    continue  # records hold whole steps and start right after a checkpoint
                events = self._decoded(rec)
                if rec[2] > step:  # stop at the end of the asked step
                    end = next(
                        i
                        for i, e in enumerate(events)
                        if type(e) is StepSnapshot and e.step == step
                    )
                    events = events[: end + 1]
                state.apply_all(events)
        except TraceError:
            raise  # already says what is wrong
        except (IndexError, ValueError, StopIteration) as e:
            raise TraceError(
                f"{self.path}: events do not fit the header's cache ({_reason(e)})"
            ) from None
        return state

    def replay_from(self, seq_id: int) -> tuple[CacheState, Iterator[Event]]:
        """For following one request: the cache state at a checkpoint before the request
        arrived (its block tables; no token ids), and every event from there on."""
        state = CacheState(self.num_blocks)
        if self._v1 is not None:
            return state, self.events()
        self._new_view()
        arrival = 0  # the first step of the events record right after its prompt record
        for i, rec in enumerate(self.records):
            if rec[0] == b"P" and rec[1] <= seq_id <= rec[2]:
                arrival = next((r[1] for r in self.records[i:] if r[0] == b"E"), 0)
                break
        checkpoint = None
        for rec in self.records:
            if rec[0] == b"C" and rec[1] < arrival:
                checkpoint = rec
        start = 0
        if checkpoint is not None:
            cp = self._payload(checkpoint)
            try:
                state.ref_count, _, state.block_tables = self._books(cp)
                self._checkpoint_snapshot(cp, checkpoint)
            except TraceError:
                raise
            except (KeyError, TypeError, ValueError, IndexError) as e:
                raise TraceError(f"{self.path}: damaged checkpoint ({_reason(e)})") from None
            start = checkpoint[1] + 1

        def events() -> Iterator[Event]:
            for rec in self.records:
                if rec[0] == b"E" and rec[2] >= start:
                    yield from self._decoded(rec, tokens=False)

        return state, events()

    def _restore(self, state: CacheState, checkpoint) -> None:
        cp = self._payload(checkpoint)
        try:
            state.ref_count, state.block_hash, state.block_tables = self._books(cp)
            self._resolve_sources(state, cp["sources"])
            for seq_id in cp["unfinished"]:
                state.prompts[seq_id] = self.prompt(seq_id)[0]
            state.last_snapshot = self._checkpoint_snapshot(cp, checkpoint)
        except TraceError:
            raise  # already says what is wrong
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise TraceError(f"{self.path}: damaged checkpoint ({_reason(e)})") from None

    def _checkpoint_snapshot(self, cp: dict[str, Any], checkpoint) -> StepSnapshot:
        """The checkpoint's last snapshot, checked: its step is the checkpoint's, the end of
        the events before it."""
        snap = StepSnapshot(*cp["snapshot"])
        _check_event(snap, self.num_blocks)
        if snap.step != checkpoint[1]:
            raise ValueError(f"its snapshot is of step {snap.step:,}, not {checkpoint[1]:,}")
        snap.scheduled = [tuple(x) for x in snap.scheduled]
        return snap

    def _books(self, cp: dict[str, Any]) -> tuple[list[int], list[int], dict[int, list[int]]]:
        """A checkpoint's ref counts, hashes and block tables, checked against the header's
        cache: a list of another length, or a block id out of range, corrupts the state."""
        n = self.num_blocks
        ref_count = np.frombuffer(cp["ref_count"], dtype="<i4")
        block_hash = list(cp["block_hash"])
        if len(ref_count) != n or len(block_hash) != n or (ref_count < 0).any():
            raise ValueError(f"its ref counts and hashes do not fit {n:,} blocks")
        tables = {}
        for seq_id, table in cp["tables"]:
            if type(seq_id) is not int or seq_id < 0:
                raise ValueError(f"sequence id {_short(seq_id)}")
            if type(table) is not list or not all(type(b) is int and 0 <= b < n for b in table):
                raise ValueError(f"the block table of sequence {seq_id} is out of range")
            tables[seq_id] = list(table)
        return ref_count.tolist(), block_hash, tables


class _JsonlTrace:
    """Version 1: a JSONL header line, then one event per line (read-only)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with open(path, encoding="utf-8", errors="replace") as f:
            line = f.readline(MAX_HEADER_CHARS)  # a file of no newlines is not read whole
        try:
            header = json.loads(line)
        except json.JSONDecodeError:
            header = None
        if not isinstance(header, dict) or header.get("format") != TRACE_FORMAT:
            raise TraceError(
                f"{path}: not a nanokv trace (write one with `nanokv replay ... --record FILE`)"
            )
        if header.get("version") != 1:
            raise TraceError(
                f"{path}: trace format version {header.get('version')} is not supported "
                f"(this nanokv reads versions 1 and {TRACE_VERSION})"
            )
        self.model_note = _check_header(path, header, 1)
        self.header = header

    def events(self) -> Iterator[Event]:
        # Bytes, decoded line by line: a text file decodes whole chunks, so its error would
        # name the line being read, not the one holding the bad bytes.
        with open(self.path, "rb") as f:
            f.readline()
            for n, raw in enumerate(f, 2):
                if not raw.endswith(b"\n"):
                    return  # killed mid-line: the file ends at the last whole step
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError:
                    raise TraceError(f"{self.path} line {n}: not UTF-8 text") from None
                if line.strip():
                    yield self._event(line, n)

    def _event(self, line: str, n: int) -> Event:
        try:
            event = event_from_dict(json.loads(line))
            _check_event(event, self.header["num_blocks"])
            return event
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise TraceError(f"{self.path} line {n}: not a trace event ({e})") from None

    def state_at(self, step: int | None = None) -> CacheState:
        state = CacheState(self.header["num_blocks"])
        last = None
        pending: list[Event] = []
        for event in self.events():
            pending.append(event)
            if type(event) is not StepSnapshot:
                continue
            try:
                state.apply_all(pending)
            except (IndexError, ValueError) as e:
                raise TraceError(
                    f"{self.path}: events do not fit the header's cache ({e})"
                ) from None
            pending.clear()
            last = event.step
            if event.step == step:
                return state
        if last is None:
            raise TraceError(f"{self.path}: the trace holds no steps")
        if step is not None:
            raise TraceError(f"{self.path}: no step {step}; the trace has steps up to {last}")
        return state


# -- export ------------------------------------------------------------------------------------

EXPORT_FORMATS = ("jsonl", "vllm-kv-events")


def export(reader: TraceReader, fmt: str, out: IO[bytes]) -> int:
    """Write the trace's events as ``fmt``; returns the number of records written.

    ``jsonl``: a header line, then one event per line (version 1, readable by any nanokv).
    ``vllm-kv-events``: vLLM's KV event stream, one msgpack ``KVEventBatch`` per step that
    changed the prefix cache, encoded as ``serve --kv-events-config`` publishes it (one place:
    ``kv_events.py``), so a consumer of vLLM's events (a KV-aware router, a dashboard) can read
    what this run's cache did.
    """
    if fmt == "jsonl":
        header = {**reader.header, "version": 1}
        out.write((json.dumps(header) + "\n").encode())
        n = 0
        for event in reader.events():
            out.write((json.dumps(event_to_dict(event), separators=(",", ":")) + "\n").encode())
            n += 1
        return n
    if fmt != "vllm-kv-events":
        raise ValueError(f"unknown export format {fmt!r} (choose from {', '.join(EXPORT_FORMATS)})")
    start = reader.header.get("created_unix", 0.0)
    n = 0
    for payload in export_batches(reader.events(), reader.block_size, start):
        out.write(payload)
        n += 1
    return n


def explain_request(
    reader: TraceReader, seq_id: int, decode: Callable[[list[int]], str] | None = None
) -> dict[str, Any]:
    """Every prefix-cache lookup of request ``seq_id`` in a trace, block by block.

    Each lookup (its first admission, then any re-admission after preemption) lists its
    blocks: hits (shared, with the sequences holding the block then, or revived) and misses,
    with the lookup's reason for its first missed block. ``divergence``: the earlier request
    its prompt shares the most with, and where they part (the text there, with ``decode``).
    """
    from .report import explain_miss, lookup_record

    state, events = reader.replay_from(seq_id)
    lookups: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    prompt: int | None = None  # its length, from the first lookup
    seen_lookup = False
    step = 0
    bs = reader.block_size
    for event in events:
        t = type(event)
        if t is CacheLookup:
            seen_lookup = True
            current = None
            if event.seq_id == seq_id:
                rec = lookup_record(event)
                current = {
                    "step": step,
                    "first_admission": event.first,
                    "num_tokens": event.num_tokens,
                    **rec,
                    "explanation": explain_miss({**rec, "num_tokens": event.num_tokens}, bs),
                    "blocks": [],
                }
                lookups.append(current)
        elif current is not None and getattr(event, "seq_id", None) == seq_id:
            if t is BlockHit:
                holders = [s for s, table in state.block_tables.items() if event.block_id in table]
                current["blocks"].append(
                    {"block_id": event.block_id, "hit": event.kind, "held_by": sorted(holders)}
                )
            elif t is BlockAllocated:
                current["blocks"].append({"block_id": event.block_id, "hit": None})
            elif t is BlockCopied:  # the block just allocated got leading tokens copied
                current["blocks"][-1].update(
                    hit="copied", num_tokens=event.num_tokens, source_block_id=event.source_block_id
                )
            else:
                current = None
        elif t is not BlockRemoved:
            current = None  # the lookup's blocks have all been handed out
        if t is CacheLookup and event.seq_id == seq_id and event.first:
            prompt = event.num_tokens
        state.apply(event)
        if t is StepSnapshot:
            step = event.step + 1
        elif t is SequenceFinished and event.seq_id == seq_id:
            break  # nothing after this concerns it
    if not seen_lookup:
        raise TraceError(
            f"{reader.path}: this trace has no cache-lookup records (an older nanokv wrote it); "
            "record it again to explain misses"
        )
    if prompt is None:
        n = reader.num_requests() if isinstance(reader, TraceReader) else None
        valid = "" if n is None else f" (its requests are 0 to {n - 1})" if n else " (it has none)"
        raise TraceError(f"{reader.path}: no request {seq_id} in this trace{valid}")
    return {
        "seq_id": seq_id,
        "num_prompt_tokens": prompt,
        "lookups": lookups,
        "divergence": _request_divergence(reader, seq_id, decode),
    }


def _request_divergence(reader: TraceReader, seq_id: int, decode) -> dict[str, Any] | None:
    """Where request ``seq_id``'s prompt parts from the earlier one it shares the most with
    (None for a version 1 trace, whose prompts are in its events)."""
    if not isinstance(reader, TraceReader) or reader._v1 is not None:
        return None
    from .divergence import PrefixIndex

    index = PrefixIndex()
    div = None
    # Its own first: missing, the answer cannot be given (a left-out last record). Present,
    # every earlier record is too, and an id missing from them is a rejected request's.
    reader._prompts_of(seq_id)
    for s in range(seq_id + 1):  # prompts as stored: token bytes, or a recipe (not made)
        try:
            entry = reader._prompts_of(s)[s]
        except _MissingPrompt:
            continue  # a rejected request's id: it never had a prompt recorded
        if isinstance(entry, bytes):
            div = index.add(s, np.frombuffer(entry, dtype="<i4"))
        else:
            div = index.add(s, None, entry)
    return None if div is None or div.request != seq_id else index.describe(div, decode)


def describe_state(
    state: CacheState,
    block_size: int,
    decode: Callable[[list[int]], str] | None = None,
    *,
    limit: int | None = None,
) -> dict[str, Any]:
    """What ``inspect`` shows: live block tables and every block that is not free-and-clean.

    A block's tokens are known once its hash was stored; before that (a partly computed or
    unfinished block) they are read from its sequence's prompt where the prompt reaches.
    ``limit``: list at most that many blocks and sequences (the counts cover them all).
    """
    holders: dict[int, list[int]] = {}
    tokens = state.block_tokens
    for seq_id, table in state.block_tables.items():
        for b in table:
            holders.setdefault(b, []).append(seq_id)
    counts = {"free": 0, "cached": 0, "used": 0, "shared": 0}
    for kind in map(state.state, range(state.num_blocks)):
        counts[kind] += 1
    blocks = []
    for b in range(state.num_blocks):
        if limit is not None and len(blocks) >= limit:
            break
        kind = state.state(b)
        if kind == "free":
            continue
        h = state.block_hash[b]
        toks = tokens.get(b)
        if toks is None and b in holders:
            toks = _prompt_block(state, holders[b], b, block_size)
        blocks.append(
            {
                "block_id": b,
                "state": kind,
                "ref_count": state.ref_count[b],
                "hash": None if h == -1 else h,
                "seq_ids": holders.get(b, []),
                "token_ids": None if toks is None else list(toks),
                "text": decode(list(toks)) if decode and toks is not None else None,
            }
        )
    live = set(state.block_tables)
    snap = state.last_snapshot
    seq_ids = sorted(state.block_tables)
    return {
        "step": snap.step if snap else None,
        "snapshot": event_to_dict(snap) if snap else None,
        "cache": cache_numbers(snap),
        "counts": counts,
        "sequences_total": len(seq_ids),
        "sequences": [
            {
                "seq_id": seq_id,
                "num_prompt_tokens": len(state.prompts.get(seq_id, [])),
                "block_table": state.block_tables[seq_id],
            }
            for seq_id in seq_ids[:limit]
        ],
        "waiting": sorted(s for s in state.prompts if s not in live),
        "blocks_total": sum(n for kind, n in counts.items() if kind != "free"),
        "blocks_listed": len(blocks),
        "blocks": blocks,
    }


def _prompt_block(
    state: CacheState, seq_ids: list[int], b: int, block_size: int
) -> list[int] | None:
    """The tokens of block ``b`` read from a holder's prompt, where the prompt reaches it (a
    partly computed or unfinished block has no stored tokens)."""
    for seq_id in seq_ids:
        i = state.block_tables[seq_id].index(b)
        prompt = state.prompts.get(seq_id, [])
        if i * block_size < len(prompt):
            return list(prompt[i * block_size : (i + 1) * block_size])
    return None
