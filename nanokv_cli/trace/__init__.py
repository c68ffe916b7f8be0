"""Event traces: every engine event of a run, compact and seekable, for ``nanokv inspect``.

The format (version 2: zstd-framed msgpack records behind 21-byte prefixes that index the file)
is described in ``format``. The package, by concern:

* ``format``: layout, event codes, header, reading limits, errors, token bytes.
* ``checks``: what a decoded event must hold; ``frames``: bounded zstd frames.
* ``writer``: ``TraceWriter``, the listener that records a run.
* ``records`` (the index and payloads), ``budget`` (what one view may decode), ``prompts``,
  ``steps`` (events records), ``checkpoints``, put together by ``reader``'s ``TraceReader``;
  ``jsonl_v1`` reads version 1.
* ``exporter`` (``export``: JSONL, vLLM's KV events) and ``analysis`` (``explain_request``,
  ``describe_state``).

The names importers took from the single ``trace`` module are importable from here as before.
A constant is read where it is used: the writer's flush and checkpoint intervals in ``writer``,
a view's budget in ``budget``.
"""

from __future__ import annotations

from ..engine.events import (
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
)
from .analysis import describe_state, explain_request
from .exporter import EXPORT_FORMATS, export
from .format import _CODE as _CODE  # tests build and take apart records with these two
from .format import _PREFIX as _PREFIX
from .format import (
    CHECKPOINT_EVERY,
    FLUSH_EVENTS,
    FLUSH_SECONDS,
    FLUSH_STEPS,
    MAGIC,
    MAX_BLOCK_SIZE,
    MAX_HASH_IDS,
    MAX_HEADER_BYTES,
    MAX_HEADER_CHARS,
    MAX_HEADER_STRING,
    MAX_NUM_BLOCKS,
    MAX_PROMPT_TOKENS,
    MAX_RECORD_BYTES,
    MAX_RECORD_EVENTS,
    MAX_VIEW_EVENTS,
    MAX_VIEW_PROMPT_TOKENS,
    TRACE_FORMAT,
    TRACE_VERSION,
    TraceError,
    make_header,
)
from .reader import TraceReader
from .writer import TraceWriter

__all__ = [
    # the event types, as the single module carried them
    "AllBlocksCleared",
    "BlockAllocated",
    "BlockCopied",
    "BlockFreed",
    "BlockHit",
    "BlockRemoved",
    "BlockStored",
    "CacheLookup",
    "CacheState",
    "Event",
    "SequenceAdded",
    "SequenceFinished",
    "SequencePreempted",
    "StepSnapshot",
    # the format
    "CHECKPOINT_EVERY",
    "EXPORT_FORMATS",
    "FLUSH_EVENTS",
    "FLUSH_SECONDS",
    "FLUSH_STEPS",
    "MAGIC",
    "MAX_BLOCK_SIZE",
    "MAX_HASH_IDS",
    "MAX_HEADER_BYTES",
    "MAX_HEADER_CHARS",
    "MAX_HEADER_STRING",
    "MAX_NUM_BLOCKS",
    "MAX_PROMPT_TOKENS",
    "MAX_RECORD_BYTES",
    "MAX_RECORD_EVENTS",
    "MAX_VIEW_EVENTS",
    "MAX_VIEW_PROMPT_TOKENS",
    "TRACE_FORMAT",
    "TRACE_VERSION",
    "TraceError",
    # writing, reading, and what is made of a trace
    "TraceReader",
    "TraceWriter",
    "describe_state",
    "explain_request",
    "export",
    "make_header",
]
