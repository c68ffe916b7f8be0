"""Typed, ordered events for every change of KV-block state, plus one snapshot per step.

Everything outside the engine (live views, traces, ``inspect``, reports) learns about the cache
only from these. Emitters check for a listener before building an event, so an engine nobody
listens to pays one attribute test per change and allocates nothing.

Names follow vLLM's KV events where the meaning is the same: ``BlockStored`` (a full, computed
block's hash was registered) and ``BlockRemoved`` (a hash left the prefix cache: eviction).
A hash may be stored by several blocks (a duplicate: the newest serves it); ``BlockRemoved``
comes once, when the last of them is reused.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass, field, fields
from typing import Any, Literal


@dataclass(slots=True)
class SequenceAdded:
    seq_id: int
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_time: float
    prompt_recipe: list | None = None  # how the prompt was made, when it was synthesized


@dataclass(slots=True)
class CacheLookup:
    """A sequence was admitted: ``num_tokens`` looked up, ``num_hit_tokens`` served from the
    prefix cache, and why the rest missed (``reason``: one of ``cache_stats.MISS_REASONS``,
    for logical block ``miss_block`` and every block after it). ``first`` is False for a
    re-admission after preemption, whose lookups stay out of the headline hit rate."""

    seq_id: int
    num_tokens: int
    num_hit_tokens: int
    first: bool
    reason: str
    miss_block: int
    evicted_at_step: int = -1  # ``evicted``: the step the block's hash left the cache
    partial_tokens: int = 0  # ``partial``: tokens of the block shared with an earlier prompt


@dataclass(slots=True)
class BlockAllocated:
    """A cache miss: ``block_id`` was taken from the head of the free queue for ``seq_id``."""

    seq_id: int
    block_id: int


@dataclass(slots=True)
class BlockHit:
    """A prefix-cache hit. ``shared``: the block was in use and its ref count grew;
    ``revived``: it sat in the free queue with its hash and was taken back out."""

    seq_id: int
    block_id: int
    block_hash: int
    kind: Literal["shared", "revived"]


@dataclass(slots=True)
class BlockCopied:
    """A token-granular prefix-cache hit: the K/V of ``num_tokens`` leading tokens of
    ``block_id`` (just allocated to ``seq_id``) are copied from ``source_block_id``, a block
    continuing the same prefix, instead of being computed."""

    seq_id: int
    block_id: int
    source_block_id: int
    num_tokens: int


@dataclass(slots=True)
class BlockStored:
    """A full block's KV was computed and its chained hash registered."""

    block_id: int
    block_hash: int
    parent_hash: int  # -1 for a sequence's first block
    token_ids: list[int]


@dataclass(slots=True)
class BlockRemoved:
    """Eviction: a free block carrying a hash was reused, so the hash left the cache."""

    block_id: int
    block_hash: int


@dataclass(slots=True)
class BlockRestored:
    """A hit from the second tier (``kv_tier``): logical block content ``block_hash``, evicted
    from the device cache earlier, was read back from ``medium`` into ``block_id`` (just
    allocated to ``seq_id`` and registered: a ``BlockAllocated`` and a ``BlockStored`` come
    before it) instead of being recomputed."""

    seq_id: int
    block_id: int
    block_hash: int
    medium: Literal["disk", "host"]


@dataclass(slots=True)
class TierStored:
    """An evicted block's content went to the second tier (right after its ``BlockRemoved``)."""

    block_hash: int
    medium: Literal["disk", "host"]


@dataclass(slots=True)
class TierRemoved:
    """The second tier let a block go: its least recently used, to make room, or a copy it
    could not read back intact."""

    block_hash: int
    medium: Literal["disk", "host"]


@dataclass(slots=True)
class AllBlocksCleared:
    """The whole prefix cache was dropped."""


@dataclass(slots=True)
class BlockFreed:
    """``seq_id`` let go of ``block_id``; at ``ref_count == 0`` it went to the free queue's tail."""

    seq_id: int
    block_id: int
    ref_count: int


@dataclass(slots=True)
class SequencePreempted:
    seq_id: int
    num_tokens: int


@dataclass(slots=True)
class SequenceFinished:
    seq_id: int
    reason: Literal["stop", "length", "abort"]
    num_prompt_tokens: int
    num_completion_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache at first admission


@dataclass(slots=True)
class StepSnapshot:
    step: int
    kind: Literal["prefill", "decode", "mixed", "idle"]
    num_free_blocks: int
    num_used_blocks: int
    num_cached_free_blocks: int  # free but still holding a hash: reusable until evicted
    num_running: int
    num_waiting: int
    num_prefill_tokens: int
    num_decode_tokens: int
    wall_time: float  # seconds spent in this step
    clock: float  # engine clock at the end of the step (wall or virtual seconds)
    # Cumulative prefix-cache counters, named and defined as in cache_stats.CacheStats:
    queries: int  # prompt tokens looked up at first admission
    hits: int  # ...served from the cache (shared + revived + copied)
    shared_hits: int
    revived_hits: int
    evictions: int
    preemptions: int
    scheduled: list[tuple[int, int]] = field(default_factory=list)  # (seq_id, num_tokens)
    readmission_queries: int = 0  # tokens looked up again after preemption
    readmission_hits: int = 0
    miss_tokens: dict[str, int] = field(default_factory=dict)  # missed tokens by reason
    copied_hits: int = 0  # traces written before it decode positionally without it
    # Appended likewise (kv_tier): hits restored from the second tier, and its blocks held.
    restored_hits: int = 0
    tier_blocks: int = 0
    # Blocks in use while the step computed: ``num_used_blocks`` is read after finished
    # sequences gave theirs back, so a run of one-token requests would never show its peak.
    step_used_blocks: int = 0


Event = (
    SequenceAdded
    | CacheLookup
    | BlockAllocated
    | BlockHit
    | BlockStored
    | BlockRemoved
    | AllBlocksCleared
    | BlockFreed
    | SequencePreempted
    | SequenceFinished
    | StepSnapshot
    | BlockCopied
    | BlockRestored
    | TierStored
    | TierRemoved
)
EventListener = Callable[[Event], None]

EVENT_TYPES: dict[str, type] = {cls.__name__: cls for cls in Event.__args__}


def event_to_dict(event: Event) -> dict[str, Any]:
    """A JSON-ready dict (token arrays become lists) with the event's class in ``type``."""
    d = {"type": type(event).__name__}
    for f in fields(event):
        v = getattr(event, f.name)
        d[f.name] = list(v) if isinstance(v, array) else v
    return d


def event_from_dict(d: dict[str, Any]) -> Event:
    d = dict(d)
    cls = EVENT_TYPES[d.pop("type")]
    names = {f.name for f in fields(cls)}
    kwargs = {k: v for k, v in d.items() if k in names}
    if cls is StepSnapshot:
        kwargs["scheduled"] = [tuple(x) for x in kwargs.get("scheduled", [])]
    return cls(**kwargs)


class EventBus:
    """Fans events out to listeners. Falsy while nobody listens, which emitters test first."""

    def __init__(self) -> None:
        self.listeners: list[EventListener] = []

    def __bool__(self) -> bool:
        return bool(self.listeners)

    def subscribe(self, listener: EventListener) -> Callable[[], None]:
        self.listeners.append(listener)
        return lambda: self.listeners.remove(listener)

    def __call__(self, event: Event) -> None:
        for listener in self.listeners:
            listener(event)


class CacheState:
    """The block map rebuilt from events alone: what views, traces and ``inspect`` show.

    It mirrors the BlockManager's books (ref counts, hashes, block tables) without touching it,
    so anything that can see the event stream can see the cache. This is the one place the
    rules of how an event changes those books live: the live view, the trace writer and
    reader, ``inspect`` and the cache stream all apply events through it, and keep only their
    own books beside it (``listener``'s ``then``, or reading these after each event).

    ``keep_tokens=False`` keeps ref counts, hashes and block tables only (no block tokens, no
    prompts): a live view holds no token list, which the garbage collector would keep scanning.
    """

    def __init__(self, num_blocks: int, *, keep_tokens: bool = True) -> None:
        self.num_blocks = num_blocks
        self.keep_tokens = keep_tokens
        self.ref_count = [0] * num_blocks
        self.block_hash = [-1] * num_blocks
        self.block_tokens: dict[int, list[int]] = {}
        self.block_tables: dict[int, list[int]] = {}
        self.prompts: dict[int, list[int]] = {}  # of the sequences that have not finished
        self.last_snapshot: StepSnapshot | None = None

    def apply(self, event: Event) -> None:
        self.apply_all((event,))

    def apply_all(self, events: Iterable[Event]) -> list[Event]:
        """Apply events in order; return those that are not block allocations, frees, stores
        or removals (hits, sequence and step events), for callers that track more."""
        others: list[Event] = []
        apply = self.listener(others.append)
        for event in events:
            apply(event)
        return others

    def listener(self, then: EventListener | None = None) -> EventListener:
        """A function that applies one event to the books, and hands each event that is not
        a block allocation, free, store or removal on to ``then`` after applying it.

        It is ``send`` of a generator: a live view applies every event of a dry run as it
        arrives (a few hundred thousand a second), and a generator's locals stay put between
        events where a closure copies its variables into every call. It follows the books as
        they are when it is made: one that replaces a book afterwards makes a new listener."""
        applier = self._applier(then)
        next(applier)  # run to the first ``yield``
        return applier.send

    def _applier(self, then: EventListener | None) -> Generator[None, Event, None]:
        ref_count, block_hash, tables = self.ref_count, self.block_hash, self.block_tables
        tokens, prompts, keep = self.block_tokens, self.prompts, self.keep_tokens
        # The hot names as locals: globals cost a lookup per event.
        type_of = type
        Freed, Allocated, Stored, Removed = BlockFreed, BlockAllocated, BlockStored, BlockRemoved
        while True:
            event = yield
            t = type_of(event)
            # The per-block events first: ~97% of a dry run's.
            if t is Freed:
                b = event.block_id
                ref_count[b] = event.ref_count
                try:  # cheaper than tables.get(), as with allocations below
                    table = tables[event.seq_id]
                except KeyError:
                    continue  # a table this state never saw: it began following mid-run
                if table:
                    # deallocate() frees a table from its end: pop is O(1) where remove is O(n).
                    if table[-1] == b:
                        table.pop()
                    else:
                        table.remove(b)
                    if not table:
                        del tables[event.seq_id]
            elif t is Allocated:
                b = event.block_id
                ref_count[b] = 1
                block_hash[b] = -1
                if keep:
                    tokens.pop(b, None)
                try:  # cheaper than tables.get() here: a sequence's first block is the rare case
                    tables[event.seq_id].append(b)
                except KeyError:
                    tables[event.seq_id] = [b]
            elif t is Stored:
                block_hash[event.block_id] = event.block_hash
                if keep:
                    tokens[event.block_id] = event.token_ids  # never mutated by the engine
            elif t is Removed:
                block_hash[event.block_id] = -1
                if keep:
                    tokens.pop(event.block_id, None)
            else:
                if t is BlockHit:
                    ref_count[event.block_id] += 1
                    tables.setdefault(event.seq_id, []).append(event.block_id)
                elif t is StepSnapshot:
                    self.last_snapshot = event
                elif t is SequenceAdded:
                    if keep:
                        prompts[event.seq_id] = event.prompt_token_ids
                elif t is SequenceFinished:
                    prompts.pop(event.seq_id, None)
                elif t is AllBlocksCleared:
                    block_hash[:] = [-1] * self.num_blocks
                    tokens.clear()
                if then is not None:
                    then(event)

    def state(self, block_id: int) -> str:
        """``free`` (clean), ``cached`` (free, hash kept), ``used`` (one owner) or ``shared``."""
        rc = self.ref_count[block_id]
        if rc == 0:
            return "cached" if self.block_hash[block_id] != -1 else "free"
        return "shared" if rc > 1 else "used"
