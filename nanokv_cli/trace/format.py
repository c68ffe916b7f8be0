"""The trace format: its layout, event codes, header, reading limits and errors.

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

import struct
import sys
import time
from array import array
from dataclasses import fields
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import zstandard

from ..engine.core.events import (
    AllBlocksCleared,
    BlockAllocated,
    BlockCopied,
    BlockFreed,
    BlockHit,
    BlockRemoved,
    BlockRestored,
    BlockStored,
    CacheLookup,
    SequenceAdded,
    SequenceFinished,
    SequencePreempted,
    StepSnapshot,
    TierRemoved,
    TierStored,
)
from ..version import __version__
from ..workload.mooncake import MAX_LINE_CHARS as MOONCAKE_LINE_CHARS

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
    BlockRestored,  # appended likewise (the second tier, kv_tier)
    TierStored,
    TierRemoved,
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
