"""The cache stream of ``nanokv serve`` (``GET /v1/nanokv/events``), which ``nanokv top`` reads.

It carries what the local live view shows, as server-sent events:

* ``snapshot``: ``{"server": identity, "frame": n, "blocks": codes, "stats": stats}`` first, and
  again whenever a watcher fell behind or an eighth of the blocks changed at once. ``identity`` names the server:
  ``instance_id`` (new at every start), ``model``, ``block_size``, ``num_blocks``, ``started``
  (Unix time). ``codes`` is one byte per block, zlib-compressed and base64-encoded: 0 free,
  1-254 the ref count (254: 254 or more), 255 free but cached (its hash kept).
* ``delta``: ``{"frame": n, "blocks": [[block_id, code], ...], "stats": stats}``, the blocks
  that changed since frame n - 1. A delta is sent at most every ``interval`` (0.1 s) while the
  engine steps, and once a second (no blocks) while it idles, so a watcher sees the rate drop.
* ``bye``: ``{"reason": ...}``, the server is stopping.

``stats`` is the engine's last ``StepSnapshot`` (as ``events.event_to_dict``, without its
``scheduled`` list: hits by kind, miss reasons, block counts, running/waiting), plus
``finished`` requests, ``tokens_total`` and ``tokens_per_s`` (prefill + decode tokens over the
last two seconds, as the live view counts them), ``idle_s`` (since the last step), ``uptime_s``
and ``time``.

Two threads share the work. The engine thread only appends each event to a deque
(``CacheRecorder.listener``): no lock, no wake-up, nothing that waits. The event loop, every
``interval``, applies the events of the steps that ended to a ``CacheState`` and the codes,
and fans the frame out to at most ``max_watchers`` bounded queues (``CacheStream``): a
watcher whose queue is full (it reads slower than the server writes) has it emptied and gets
a fresh snapshot instead. Should the loop fall ``max_pending`` events behind, the engine
thread applies them itself after a step, if the lock is free (it never waits for it).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import threading
import time
import uuid
import zlib
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np

from ..engine.core.events import (
    AllBlocksCleared,
    BlockAllocated,
    BlockFreed,
    BlockHit,
    BlockRemoved,
    BlockStored,
    CacheState,
    Event,
    SequenceFinished,
    StepSnapshot,
    event_to_dict,
)

log = logging.getLogger(__name__)
EVENTS_PATH = "/v1/nanokv/events"  # under /v1: the API key guards it as it guards the API
PROTOCOL = 1
FREE, CACHED, MAX_REF = 0, 255, 254
# The most blocks a stream's map may hold (a trace's bound too): 16 MB of codes. A server's
# cache is far smaller; a watcher refuses a snapshot that claims more.
MAX_NUM_BLOCKS = 1 << 24
_ZLIB_MAX_RATIO = 1032  # deflate's best: 258 bytes in two bits, and a little more
RATE_WINDOW_S = 2.0
# Events that change a block's ref count or hash (BlockCopied's block is also allocated).
_CHANGES_BLOCK = (BlockAllocated, BlockFreed, BlockHit, BlockStored, BlockRemoved)


# While a watcher is being refused, every frame is followed by this comment: 16 KB a frame
# (about 16 KB a second when idle) fills a reader's kernel buffers in seconds if it reads nothing.
PROBE_S = 60.0
PROBE_PADDING = ":" + " " * (16 << 10) + "\n\n"


class WatcherLimit(Exception):
    """No room for another watcher (or the stream has closed)."""


def block_code(ref_count: int, block_hash: int) -> int:
    if ref_count:
        return ref_count if ref_count <= MAX_REF else MAX_REF
    return CACHED if block_hash != -1 else FREE


def all_codes(state: CacheState) -> bytes:
    """Every block's code, at once (numpy: a cache has up to millions of blocks)."""
    rc = np.minimum(np.array(state.ref_count, np.int64), MAX_REF).astype(np.uint8)
    hashed = np.array(state.block_hash, object) != -1  # hashes are unsigned 64-bit ints
    return np.where(rc > 0, rc, np.where(hashed, CACHED, FREE)).astype(np.uint8).tobytes()


def encode_codes(codes: bytes | bytearray) -> str:
    return base64.b64encode(zlib.compress(bytes(codes), 1)).decode("ascii")


def decode_codes(text: str, num_blocks: int) -> bytearray:
    """``encode_codes``' inverse; ValueError unless it holds exactly ``num_blocks`` codes.

    The count is the sender's claim: it is checked against ``MAX_NUM_BLOCKS`` and against
    what the text can hold (zlib packs at most ~1032 bytes into one) before anything is
    allocated, so a small frame claiming 10^9 blocks costs nothing."""
    if not 0 < num_blocks <= MAX_NUM_BLOCKS:
        raise ValueError(f"a snapshot of {num_blocks:,} blocks (at most {MAX_NUM_BLOCKS:,})")
    if num_blocks > _ZLIB_MAX_RATIO * (len(text) * 3 // 4 + 1):
        raise ValueError(f"a snapshot's block map is too short for {num_blocks:,} blocks")
    try:
        d = zlib.decompressobj()
        codes = d.decompress(base64.b64decode(text, validate=True), num_blocks + 1)
    except (ValueError, zlib.error) as e:
        raise ValueError(f"a snapshot's block map does not decode: {e}") from None
    if len(codes) != num_blocks or d.unconsumed_tail:
        raise ValueError(f"a snapshot's block map has the wrong size (not {num_blocks} blocks)")
    return bytearray(codes)


# -- the books, and the engine thread's part -----------------------------------------------------


class CacheRecorder:
    """The stream's books (a ``CacheState``, the codes, the counters), fed by the engine.

    The engine thread's part is ``listener``, which is ``pending.append`` (a deque's: safe
    between threads, and the cheapest listener there is), and ``step_ended`` once per step.
    ``apply_pending`` (under ``lock``, on the event loop) applies the events of every step
    that has ended. Only if ``max_pending`` events pile up (the loop is starved) does the
    engine thread apply them itself, and only if the lock is free at once: it never waits."""

    def __init__(self, num_blocks: int, max_pending: int = 1 << 16) -> None:
        # The stream shows no tokens: its books keep none of every cached block's.
        self.state = CacheState(num_blocks, keep_tokens=False)
        self.codes = bytearray(num_blocks)  # an engine starts with every block free
        self.changed: dict[int, int] = {}  # block -> code since ``take_changes``
        self.whole = False  # every code may have changed (AllBlocksCleared)
        self.snapshot: StepSnapshot | None = None
        self.finished = 0
        self.tokens_total = 0
        self.steps: deque[tuple[float, int]] = deque()  # (clock, tokens) of recent steps
        self.lock = threading.Lock()
        self.pending: deque[Event] = deque()
        self.listener = self.pending.append
        self.max_pending = max_pending
        self.catch_ups = 0  # times the engine thread applied the pending events itself
        self._step: list[Event] = []  # the events of a step still running (under ``lock``)

    def step_ended(self) -> None:
        """The engine thread, after each step: catch up if the loop has fallen behind."""
        if len(self.pending) > self.max_pending and self.lock.acquire(blocking=False):
            try:
                self.catch_ups += 1
                self.apply_pending()
            finally:
                self.lock.release()

    def apply_pending(self) -> None:
        """Apply the events of the steps that have ended (hold ``lock``); a step's events
        wait for its snapshot, so the codes and the counters always describe one step."""
        pending, step = self.pending, self._step
        while True:
            try:
                event = pending.popleft()
            except IndexError:  # empty
                return
            step.append(event)
            if type(event) is StepSnapshot:
                self._apply_step(step)
                step.clear()

    def _apply_step(self, events: list[Event]) -> None:
        state, codes, changed = self.state, self.codes, self.changed
        others = state.apply_all(events)
        for e in others:
            t = type(e)
            if t is StepSnapshot:
                self.snapshot = e
                n = e.num_prefill_tokens + e.num_decode_tokens
                self.tokens_total += n
                self.steps.append((e.clock, n))
                while self.steps[0][0] <= e.clock - RATE_WINDOW_S:  # the rate's window
                    self.steps.popleft()
            elif t is SequenceFinished:
                self.finished += 1
            elif t is AllBlocksCleared:
                codes[:] = all_codes(state)
                self.whole = True
        ref_count, block_hash = state.ref_count, state.block_hash
        for b in {e.block_id for e in events if type(e) in _CHANGES_BLOCK}:
            code = block_code(ref_count[b], block_hash[b])
            if codes[b] != code:  # a hash stored on a used block changes no code
                codes[b] = code
                changed[b] = code

    def take_changes(self) -> dict[int, int] | None:
        """The blocks changed since the last call, or None if (nearly) every block may have
        (hold ``lock``)."""
        changed, self.changed = self.changed, {}
        whole, self.whole = self.whole, False
        return None if whole or len(changed) > len(self.codes) // 8 else changed


# -- the event loop -----------------------------------------------------------------------------


class _Watcher:
    def __init__(self, size: int) -> None:
        self.queue: asyncio.Queue[str | None] = asyncio.Queue(size)
        self.resyncs = 0

    def put(self, frame: str | None, fresh: Callable[[], str]) -> None:
        """Queue ``frame``; if the queue is full, replace its contents with ``fresh()``."""
        try:
            self.queue.put_nowait(frame)
            return
        except asyncio.QueueFull:
            pass
        while not self.queue.empty():
            self.queue.get_nowait()
        if frame is not None:
            self.resyncs += 1
            frame = fresh()
        self.queue.put_nowait(frame)


def _sse(event: str, obj: Any) -> str:
    return f"event: {event}\ndata: {json.dumps(obj, separators=(',', ':'))}\n\n"


class CacheStream:
    """The event loop's part: frames from the recorder's books, and the watchers."""

    def __init__(
        self,
        recorder: CacheRecorder,
        identity: dict[str, Any],
        now: Callable[[], float],
        *,
        max_watchers: int = 16,
        interval: float = 0.1,
        heartbeat: float = 1.0,
        queue_frames: int = 32,
    ) -> None:
        self.recorder = recorder
        self.identity = {
            "protocol": PROTOCOL,
            "instance_id": uuid.uuid4().hex,
            "started": time.time(),
            "num_blocks": recorder.state.num_blocks,
            **identity,
        }
        self.now = now  # the engine's clock: the snapshots' ``clock`` is on it
        self.max_watchers = max_watchers
        self.interval = interval
        self.heartbeat = heartbeat
        self.queue_frames = queue_frames
        self.frame = 0
        self.watchers: set[_Watcher] = set()
        self.closed = False
        self._last_frame = 0.0
        self._pump: asyncio.Task | None = None
        self._snapshot: str | None = None  # this frame's, once built
        self._sent: StepSnapshot | None = None  # the step the last frame showed
        self.probe_until = 0.0  # until then every frame is followed by PROBE_PADDING

    def start(self) -> None:
        """Apply the engine's steps every ``interval`` from now on (call in the event loop)."""
        if self._pump is None and not self.closed:
            self._pump = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        try:
            while True:
                await asyncio.sleep(self.interval)
                self.tick()
        except Exception:  # a bug here must not take the server down: end the stream
            log.exception("nanokv: the cache stream stopped")
            self.close()

    # -- watchers --------------------------------------------------------------------------

    def open(self) -> _Watcher:
        """A new watcher, its first frame (a snapshot) queued. Raises WatcherLimit."""
        if self.closed:
            raise WatcherLimit("the server is shutting down")
        if len(self.watchers) >= self.max_watchers:
            # Someone is waiting: make every watcher show it still reads (see ``frames``).
            self.probe_until = time.monotonic() + PROBE_S
            raise WatcherLimit(
                f"{self.max_watchers} watchers are connected, the limit; those that read "
                f"nothing are closed within a minute, so try again then"
            )
        self.start()
        w = _Watcher(self.queue_frames)
        w.put(self.snapshot_frame(), self.snapshot_frame)
        self.watchers.add(w)
        return w

    async def frames(self, w: _Watcher) -> AsyncIterator[str]:
        """The watcher's frames until the stream closes (the response ends it if the client
        leaves, then calls ``discard``: a generator never started never runs a ``finally``)."""
        while True:
            frame = await w.queue.get()
            if frame is None:
                yield _sse("bye", {"reason": "the server is shutting down"})
                return
            yield frame
            if time.monotonic() < self.probe_until:
                # A watcher was refused. Idle frames are small, so a watcher that reads nothing
                # would take many minutes to fill its kernel buffers and stall: padding (an SSE
                # comment, which readers skip) fills them in seconds, and the server closes a
                # stalled response (``timeout_write``), freeing its place.
                yield PROBE_PADDING

    def discard(self, w: _Watcher) -> None:
        self.watchers.discard(w)

    def close(self) -> None:
        """End every watcher's stream (with a ``bye``) and refuse new ones."""
        self.closed = True
        if self._pump is not None:
            self._pump.cancel()
        for w in self.watchers:
            w.put(None, self.snapshot_frame)

    # -- frames ----------------------------------------------------------------------------

    def tick(self) -> None:
        """Apply the engine's steps; send a frame if blocks changed or a heartbeat is due."""
        rec = self.recorder
        with rec.lock:
            rec.apply_pending()
            changed = rec.take_changes()
            due = time.monotonic() - self._last_frame >= self.heartbeat
            if changed == {} and rec.snapshot is self._sent and not due:
                return
            self.frame += 1
            self._sent = rec.snapshot
            self._last_frame = time.monotonic()
            self._snapshot = None
            if not self.watchers:
                return
            if changed is None:  # most of the map: smaller as a snapshot than as pairs
                frame = self._snapshot_frame()
            else:
                data = {
                    "frame": self.frame,
                    "blocks": sorted(changed.items()),
                    "stats": self._stats(),
                }
                frame = _sse("delta", data)
        for w in self.watchers:
            w.put(frame, self.snapshot_frame)

    def tokens_per_s(self) -> float:
        """Prefill and decode tokens a second, over the last ``RATE_WINDOW_S`` (hold the lock)."""
        now = self.now()
        window = min(RATE_WINDOW_S, now) if now > 0 else RATE_WINDOW_S
        return sum(n for clock, n in self.recorder.steps if clock > now - window) / window

    def _stats(self) -> dict[str, Any]:
        rec = self.recorder
        snap = None
        if rec.snapshot is not None:
            snap = event_to_dict(rec.snapshot)
            del snap["type"], snap["scheduled"]  # which sequences ran: not the watchers' business
        last = rec.snapshot.clock if rec.snapshot is not None else 0.0
        return {
            "step": snap,
            "idle_s": max(0.0, self.now() - last),  # since the last step ended
            "finished": rec.finished,
            "tokens_total": rec.tokens_total,
            "tokens_per_s": self.tokens_per_s(),
            "uptime_s": time.time() - self.identity["started"],
            "time": time.time(),
        }

    def snapshot_frame(self) -> str:
        """This frame's snapshot (built once per frame, for however many watchers need it)."""
        with self.recorder.lock:
            return self._snapshot_frame()

    def _snapshot_frame(self) -> str:
        if self._snapshot is None:
            data = {
                "server": self.identity,
                "frame": self.frame,
                "blocks": encode_codes(self.recorder.codes),
                "stats": self._stats(),
            }
            self._snapshot = _sse("snapshot", data)
        return self._snapshot
