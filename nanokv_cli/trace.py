"""Event traces: a JSONL file of every engine event, readable by ``nanokv inspect``.

Line 1 is a header object (``{"format": "nanokv-trace", "version": 1, ...}`` with the cache
geometry and the model path, so ``inspect`` can show block text). Every further line is one
event as ``events.event_to_dict`` writes it. Lines are flushed after each step snapshot, so a run
stopped by Ctrl-C (or killed) leaves a file that ends on a whole step.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import fields
from pathlib import Path
from typing import IO, Any

from . import __version__
from .engine.events import (
    EVENT_TYPES,
    BlockAllocated,
    BlockHit,
    BlockRemoved,
    CacheLookup,
    CacheState,
    Event,
    SequenceAdded,
    StepSnapshot,
    event_from_dict,
    event_to_dict,
)

TRACE_FORMAT = "nanokv-trace"
TRACE_VERSION = 1

# Field names per event class, looked up once: asdict() deep-copies and is several times slower.
_FIELDS = {cls: tuple(f.name for f in fields(cls)) for cls in EVENT_TYPES.values()}


class TraceError(ValueError):
    """A file that is not a readable nanokv trace; the message names the file and line."""


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
        **extra,
    }


def encode_event(event: Event) -> str:
    cls = type(event)
    d: dict[str, Any] = {"type": cls.__name__}
    for name in _FIELDS[cls]:
        d[name] = getattr(event, name)
    # Synthesized prompts are int64 arrays; JSON gets them as lists.
    return json.dumps(d, separators=(",", ":"), default=list)


class TraceWriter:
    """An event listener that appends each event to a trace file, flushing once per step."""

    def __init__(self, path: str | Path, header: dict[str, Any]) -> None:
        self.path = Path(path)
        self._file: IO[str] | None = open(self.path, "w", encoding="utf-8")  # noqa: SIM115
        self._pending: list[str] = [json.dumps(header)]
        self.flush()

    def __call__(self, event: Event) -> None:
        self._pending.append(encode_event(event))
        if type(event) is StepSnapshot:
            self.flush()

    def flush(self) -> None:
        if self._file is None or not self._pending:
            return
        self._file.write("\n".join(self._pending) + "\n")
        self._file.flush()
        self._pending.clear()

    def close(self) -> None:
        if self._file is not None:
            self.flush()
            self._file.close()
            self._file = None

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TraceReader:
    """Reads a trace's header at once and its events on demand."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise TraceError(f"{self.path}: no such file")
        with self._open() as f:
            self.header = self._parse_header(f.readline())

    def _open(self) -> IO[str]:
        try:
            return open(self.path, encoding="utf-8")  # noqa: SIM115
        except OSError as e:
            raise TraceError(f"{self.path}: {e.strerror}") from None

    def _parse_header(self, line: str) -> dict[str, Any]:
        try:
            header = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            header = None
        if not isinstance(header, dict) or header.get("format") != TRACE_FORMAT:
            raise TraceError(
                f"{self.path}: not a nanokv trace (write one with `nanokv replay ... --record FILE`)"
            )
        if header.get("version") != TRACE_VERSION:
            raise TraceError(
                f"{self.path}: trace format version {header.get('version')} is not supported "
                f"(this nanokv reads version {TRACE_VERSION})"
            )
        for key in ("block_size", "num_blocks"):
            if not isinstance(header.get(key), int) or header[key] < 1:
                raise TraceError(f"{self.path} line 1: header lacks a valid {key!r}")
        return header

    @property
    def block_size(self) -> int:
        return self.header["block_size"]

    @property
    def num_blocks(self) -> int:
        return self.header["num_blocks"]

    def events(self) -> Iterator[Event]:
        with self._open() as f:
            f.readline()
            for n, line in enumerate(f, 2):
                if not line.endswith("\n"):
                    return  # the writer was killed mid-line: the file ends at the last whole step
                if line.strip():
                    yield self._parse_event(line, n)

    def _parse_event(self, line: str, n: int) -> Event:
        try:
            return event_from_dict(json.loads(line))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise TraceError(f"{self.path} line {n}: not a trace event ({e})") from None

    def state_at(self, step: int | None = None) -> CacheState:
        """The cache as it stood at the end of ``step`` (default: the last recorded step)."""
        state = CacheState(self.num_blocks)
        last = None
        # Events after the last snapshot belong to a step cut short (Ctrl-C): hold each step's
        # events back until its snapshot shows it completed.
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


def explain_request(reader: TraceReader, seq_id: int) -> dict[str, Any]:
    """Every prefix-cache lookup of request ``seq_id`` in a trace, block by block.

    Each lookup (its first admission, then any re-admission after preemption) lists its
    blocks: hits (shared, with the sequences holding the block then, or revived) and misses,
    with the lookup's reason for its first missed block.
    """
    from .report import explain_miss, lookup_record

    state = CacheState(reader.num_blocks)
    lookups: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    prompt: list[int] | None = None
    seen_lookup = False
    step = 0
    bs = reader.block_size
    for event in reader.events():
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
                    "explanation": explain_miss(rec, bs),
                    "blocks": [],
                }
                lookups.append(current)
        elif current is not None and getattr(event, "seq_id", None) == seq_id:
            if t is BlockHit:
                holders = [
                    s for s, table in state.block_tables.items() if event.block_id in table
                ]
                current["blocks"].append(
                    {"block_id": event.block_id, "hit": event.kind, "held_by": sorted(holders)}
                )
            elif t is BlockAllocated:
                current["blocks"].append({"block_id": event.block_id, "hit": None})
            else:
                current = None
        elif t is not BlockRemoved:
            current = None  # the lookup's blocks have all been handed out
        if t is SequenceAdded and event.seq_id == seq_id:
            prompt = event.prompt_token_ids
        state.apply(event)
        if t is StepSnapshot:
            step = event.step + 1
    if not seen_lookup:
        raise TraceError(
            f"{reader.path}: this trace has no cache-lookup records (an older nanokv wrote it); "
            "record it again to explain misses"
        )
    if prompt is None:
        raise TraceError(f"{reader.path}: no request {seq_id} in this trace")
    return {"seq_id": seq_id, "num_prompt_tokens": len(prompt), "lookups": lookups}


def describe_state(
    state: CacheState, block_size: int, decode: Callable[[list[int]], str] | None = None
) -> dict[str, Any]:
    """What ``inspect`` shows: live block tables and every block that is not free-and-clean.

    A block's tokens are known once its hash was stored; before that (a partly computed or
    unfinished block) they are read from its sequence's prompt where the prompt reaches.
    """
    holders: dict[int, list[int]] = {}
    tokens: dict[int, list[int]] = dict(state.block_tokens)
    for seq_id, table in state.block_tables.items():
        prompt = state.prompts.get(seq_id, [])
        for i, b in enumerate(table):
            holders.setdefault(b, []).append(seq_id)
            if b not in tokens and i * block_size < len(prompt):
                tokens[b] = list(prompt[i * block_size : (i + 1) * block_size])
    counts = {"free": 0, "cached": 0, "used": 0, "shared": 0}
    blocks = []
    for b in range(state.num_blocks):
        kind = state.state(b)
        counts[kind] += 1
        if kind == "free":
            continue
        h = state.block_hash[b]
        toks = tokens.get(b)
        blocks.append(
            {
                "block_id": b,
                "state": kind,
                "ref_count": state.ref_count[b],
                "hash": None if h == -1 else h,
                "seq_ids": holders.get(b, []),
                "token_ids": toks,
                "text": decode(toks) if decode and toks is not None else None,
            }
        )
    live = set(state.block_tables)
    snap = state.last_snapshot
    from .report import cache_numbers

    return {
        "step": snap.step if snap else None,
        "snapshot": event_to_dict(snap) if snap else None,
        "cache": cache_numbers(snap),
        "counts": counts,
        "sequences": [
            {
                "seq_id": seq_id,
                "num_prompt_tokens": len(state.prompts.get(seq_id, [])),
                "block_table": table,
            }
            for seq_id, table in sorted(state.block_tables.items())
        ],
        "waiting": sorted(s for s in state.prompts if s not in live and s not in state.finished),
        "blocks": blocks,
    }
