"""What a trace says about a request and a cache state: every lookup of a request block by
block and where its prompt parts from earlier ones (``inspect --request``), and the blocks
and sequences of a state (``inspect``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ..engine.core.cache_numbers import cache_numbers, explain_miss, lookup_record
from ..engine.core.events import (
    BlockAllocated,
    BlockCopied,
    BlockHit,
    BlockRemoved,
    BlockRestored,
    BlockStored,
    CacheLookup,
    CacheState,
    Event,
    SequenceFinished,
    StepSnapshot,
    TierRemoved,
    TierStored,
    event_to_dict,
)
from ..trace.format import TraceError, _MissingPrompt
from ..trace.reader import TraceReader

# Events that come between a lookup's own (evictions, a restored block's registration) and
# name no sequence: following a lookup's blocks goes on past them.
_BETWEEN = (BlockRemoved, BlockStored, TierStored, TierRemoved)


def explain_request(
    reader: TraceReader, seq_id: int, decode: Callable[[list[int]], str] | None = None
) -> dict[str, Any]:
    """Every prefix-cache lookup of request ``seq_id`` in a trace, block by block.

    Each lookup (its first admission, then any re-admission after preemption) lists its
    blocks: hits (shared, with the sequences holding the block then, or revived) and misses,
    with the lookup's reason for its first missed block. ``divergence``: the earlier request
    its prompt shares the most with, and where they part (the text there, with ``decode``).
    """
    state, events = reader.replay_from(seq_id)
    lookups, prompt, seen_lookup = _follow_lookups(state, events, seq_id, reader.block_size)
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


def _follow_lookups(
    state: CacheState, events: Iterator[Event], seq_id: int, bs: int
) -> tuple[list[dict[str, Any]], int | None, bool]:
    """The lookups of ``seq_id`` with their blocks, its prompt's length (from its first
    lookup), and whether the trace records lookups at all; ``state`` follows the events."""
    apply = state.listener()
    lookups: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    prompt: int | None = None
    seen_lookup = False
    step = 0
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
                if event.first:
                    prompt = event.num_tokens
        elif current is not None and getattr(event, "seq_id", None) == seq_id:
            if not _add_block(current["blocks"], event, state):
                current = None
        elif t not in _BETWEEN:
            current = None  # the lookup's blocks have all been handed out
        apply(event)
        if t is StepSnapshot:
            step = event.step + 1
        elif t is SequenceFinished and event.seq_id == seq_id:
            break  # nothing after this concerns it
    return lookups, prompt, seen_lookup


def _add_block(blocks: list[dict[str, Any]], event: Event, state: CacheState) -> bool:
    """Add what ``event`` says of a block of the lookup being followed; False when the event
    is not one of its blocks (the lookup's blocks have all been handed out)."""
    t = type(event)
    if t is BlockHit:
        holders = [s for s, table in state.block_tables.items() if event.block_id in table]
        blocks.append({"block_id": event.block_id, "hit": event.kind, "held_by": sorted(holders)})
    elif t is BlockAllocated:
        blocks.append({"block_id": event.block_id, "hit": None})
    elif t is BlockCopied:
        # Announced once all of the lookup's blocks are allocated, so not the last one: the
        # block it names (the first past the full-block hits) got the leading tokens.
        for block in blocks:
            if block["block_id"] == event.block_id and block["hit"] is None:
                block.update(
                    hit="copied",
                    num_tokens=event.num_tokens,
                    source_block_id=event.source_block_id,
                )
                break
    elif t is BlockRestored:  # allocated just before, as a miss: the tier served it
        for block in blocks:
            if block["block_id"] == event.block_id and block["hit"] is None:
                block.update(hit="restored", medium=event.medium)
                break
    else:
        return False
    return True


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
            if reader.was_admitted(s):  # its prompt record is gone: the trace is damaged
                raise TraceError(
                    f"{reader.path}: the prompt of sequence {s} is missing, though the trace "
                    "admits it: a prompt record was lost"
                ) from None
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
