"""vLLM's KV cache events, for routers: the wire format, and a ZMQ publisher for ``serve``.

KV-aware routers (NVIDIA Dynamo's KV router and standalone indexer, llm-d's precise prefix
scorer, AIBrix) learn which prompt prefixes an engine holds from vLLM's event stream. This
module speaks it, in one place for both users: ``serve --kv-events-config`` publishes it live
(``ZmqKVEventPublisher``) and ``inspect --export vllm-kv-events`` writes it to a file.

**The wire**, as vLLM's ``ZmqEventPublisher`` sends it: a PUB socket, one multipart message per
batch, ``[topic, sequence number (8 bytes, big-endian), payload]``, the sequence numbers
0, 1, 2, ... without gaps. The payload is msgpack of vLLM's ``KVEventBatch``, an array
``[ts, [event, ...], data_parallel_rank]``. Each event is encoded one of two ways (the
``encoding`` key of ``--kv-events-config``, nanokv's own: vLLM has one encoding at a time):

* ``map`` (the default): vLLM's encoding since its PR #42892 (June 2026, vLLM 0.26 on), a
  msgpack map per event tagged by its ``"type"`` key::

      {"type": "BlockStored", "block_hashes": [h], "parent_block_hash": p | None,
       "token_ids": [...], "block_size": n, "lora_id": None, "medium": None,
       "lora_name": None, "extra_keys": [None], "group_idx": 0,
       "kv_cache_spec_kind": "full_attention"}
      {"type": "BlockRemoved", "block_hashes": [h], "medium": None, "group_idx": 0}
      {"type": "AllBlocksCleared"}

  Fields vLLM leaves out at their default (``omit_defaults``) are left out here too: the ones
  nanokv has no meaning for (sliding window, locality, ownership, session, look-ahead tokens).
* ``array``: the positional form of vLLM before that PR, still read by older consumers::

      ["BlockStored", [block_hash], parent_block_hash | None, token_ids, block_size,
       lora_id, medium, lora_name]
      ["BlockRemoved", [block_hash], medium]
      ["AllBlocksCleared"]

Dynamo's indexer and llm-d-kv-cache (v0.9 on) read both. ``lora_id`` and ``lora_name`` are
None: no adapters. ``medium`` is None: the blocks are in the engine's own cache (vLLM writes
"GPU" there, and a consumer reads "CPU" as vLLM's host-offload tier, which a CPU engine's cache
is not). With a second tier (``--kv-tier``), a block evicted into it is announced again with the
tier's ``medium`` ("CPU" for a host tier, as vLLM's CPU offloading; "DISK" for a disk tier)
right after its ``BlockRemoved``, and a ``BlockRemoved`` with that medium when the tier lets
it go; a block restored from it is a ``BlockStored`` of the cache again. One KV cache group:
``group_idx`` 0, full attention. A block's hash is nanokv's chained
xxh64 (it stands for the whole prefix, so the parent links blocks into prefixes); its
``token_ids`` and ``block_size`` let a consumer compute its own keys, as Dynamo's indexer does.
A ROUTER socket answers replay requests ``[b"", start_seq (8 bytes)]`` with
``[b"", seq, payload]`` for every buffered batch from ``start_seq`` on, then ``[b"", -1, b""]``:
one replay between two live batches, and a peer's repeats, while one of its requests waits,
are dropped (a flood of requests neither holds back the live stream nor other peers).

**Batches.** One per engine step that changed the prefix cache (``KVEventBatcher``). A hash is
announced once: nanokv may register a content under several blocks (duplicates, the newest
serves the hash), and emits ``BlockRemoved`` only when the last copy leaves. So the batcher
keeps the set of hashes it announced, sends a ``BlockStored`` only for a hash not in it, and a
``BlockRemoved`` only for one that is. (vLLM sends every copy's ``BlockStored`` and a
``BlockRemoved`` per copy evicted, so its consumers can drop a prefix another copy still holds;
consumers of nanokv never see either.) The live publisher adds ``AllBlocksCleared`` where the
engine's cache starts and ends: at the head of its first batch (a consumer still holding what
an earlier run of this server announced drops it) and as its last batch on shutdown.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from typing import Any

import msgpack

from .engine.core.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    StepSnapshot,
    TierRemoved,
    TierStored,
)

log = logging.getLogger(__name__)

# The payload's data_parallel_rank: one engine, rank 0 (vLLM sends its rank).
DATA_PARALLEL_RANK = 0
CLEARED: list[Any] = ["AllBlocksCleared"]
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
REPLAY_READS_PER_TURN = 64  # replay requests taken from the socket per turn of the loop


# -- the wire format -----------------------------------------------------------------------------


def stored_event(
    block_hash: int, parent_hash: int, token_ids, block_size: int, medium: str | None = None
) -> list[Any]:
    """vLLM's ``BlockStored`` of one block; ``parent_hash`` -1 (a first block) goes as None."""
    parent = None if parent_hash == -1 else parent_hash
    tokens = token_ids if type(token_ids) is list else list(token_ids)  # never mutated: no copy
    return ["BlockStored", [block_hash], parent, tokens, block_size, None, medium, None]


def removed_event(block_hash: int, medium: str | None = None) -> list[Any]:
    return ["BlockRemoved", [block_hash], medium]


# The second tier's media in vLLM's words: its CPU offload tier is "CPU"; a disk is "DISK".
TIER_MEDIA = {"host": "CPU", "disk": "DISK"}


# One KV cache group, of full attention (vLLM's group index and spec kind).
GROUP_IDX = 0
SPEC_KIND = "full_attention"
ENCODINGS = ("map", "array")


def as_map(event: list[Any]) -> dict[str, Any]:
    """An event in vLLM's tagged-map encoding, from the positional form the batcher keeps."""
    tag = event[0]
    if tag == "BlockStored":
        _, hashes, parent, tokens, size, lora_id, medium, lora_name = event
        return {
            "type": tag,
            "block_hashes": hashes,
            "parent_block_hash": parent,
            "token_ids": tokens,
            "block_size": size,
            "lora_id": lora_id,
            "medium": medium,
            "lora_name": lora_name,
            "extra_keys": [None] * len(hashes),  # one per block: none of these blocks has any
            "group_idx": GROUP_IDX,
            "kv_cache_spec_kind": SPEC_KIND,
        }
    if tag == "BlockRemoved":
        _, hashes, medium = event
        return {"type": tag, "block_hashes": hashes, "medium": medium, "group_idx": GROUP_IDX}
    return {"type": tag}


def encode_batch(ts: float, events: list[list[Any]], encoding: str = "map") -> bytes:
    """One ``KVEventBatch`` payload, as vLLM's msgspec encoder writes it, events in
    ``encoding`` (``map``: today's vLLM; ``array``: vLLM before June 2026)."""
    if encoding == "map":
        events = [as_map(e) for e in events]
    return msgpack.packb([ts, events, DATA_PARALLEL_RANK])


class KVEventBatcher:
    """Engine events in, vLLM's events out: one list per step that changed the prefix cache.

    Only ``BlockStored``, ``BlockRemoved`` and ``AllBlocksCleared`` count; a ``StepSnapshot``
    closes the step. ``announced`` maps each hash a consumer holds to its ``BlockStored``
    (bounded by the cache's blocks), so a consumer that lost batches can be sent it all again.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.pending: list[list[Any]] = []
        self.announced: dict[int, list[Any]] = {}
        # The second tier's (kv_tier), by hash: what a block evicted into it was announced
        # as, with the tier's medium. ``_leaving``: the last hash that left the cache (its
        # TierStored comes right after), with what it was announced as.
        self.tier_announced: dict[int, list[Any]] = {}
        self._leaving: tuple[int, list[Any]] | None = None

    def feed(self, event: Event) -> list[list[Any]] | None:
        """Take one event; at the end of a step that changed the cache, return its events."""
        t = type(event)
        if t is BlockStored:
            h = event.block_hash
            if h not in self.announced:  # a duplicate's content is announced already
                wire = stored_event(h, event.parent_hash, event.token_ids, self.block_size)
                self.announced[h] = wire
                self.pending.append(wire)
        elif t is BlockRemoved:
            wire = self.announced.pop(event.block_hash, None)
            if wire is not None:
                self.pending.append(removed_event(event.block_hash))
                self._leaving = (event.block_hash, wire)
        elif t is TierStored or t is TierRemoved:
            self._tier(event)
        elif t is AllBlocksCleared:
            self.announced.clear()
            self.tier_announced.clear()
            self.pending.append(CLEARED)
        elif t is StepSnapshot and self.pending:
            return self.take()
        return None

    def _tier(self, event: TierStored | TierRemoved) -> None:
        """A block entered or left the second tier: vLLM's events with its medium."""
        h, medium = event.block_hash, TIER_MEDIA[event.medium]
        if type(event) is TierRemoved:
            if self.tier_announced.pop(h, None) is not None:
                self.pending.append(removed_event(h, medium))
        elif h not in self.tier_announced and self._leaving and self._leaving[0] == h:
            wire = self._leaving[1]
            tier_wire = [*wire[:6], medium, *wire[7:]]
            self.tier_announced[h] = tier_wire
            self.pending.append(tier_wire)

    def take(self) -> list[list[Any]]:
        """The events of the step in progress (a run that stops mid-step has some)."""
        events, self.pending = self.pending, []
        return events

    def resync(self) -> list[list[Any]]:
        """Everything a consumer should hold, from scratch: a clear, then every announced
        hash (in the order announced, so parents mostly come before their children)."""
        self.pending = []
        return [CLEARED, *self.announced.values(), *self.tier_announced.values()]


def export_batches(events, block_size: int, start: float, encoding: str = "map") -> Iterator[bytes]:
    """A run's events (in order) as payloads, one per step that changed the cache; a batch's
    ``ts`` is ``start`` plus the engine's clock at the end of its step."""
    batcher = KVEventBatcher(block_size)
    for event in events:
        out = batcher.feed(event)
        if out is not None:
            yield encode_batch(start + event.clock, out, encoding)


# -- the serve setting ---------------------------------------------------------------------------


@dataclass(frozen=True)
class KVEventsConfig:
    """``serve --kv-events-config``: vLLM's ``KVEventsConfig`` keys, defaults and meanings."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" or "null"; None: "zmq" when enabled
    endpoint: str = "tcp://*:5557"  # bound if it has a wildcard (or is ipc/inproc), else connected
    replay_endpoint: str | None = None  # a ROUTER bound here answers replay requests
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark (messages per subscriber)
    max_queue_size: int = 100_000  # batches waiting for the publisher thread
    topic: str = ""
    # nanokv's own key: how each event is encoded ("map", vLLM's today; "array", its old form).
    encoding: str = "map"

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher != "null"


_TYPES = {
    "enable_kv_cache_events": bool,
    "publisher": str,
    "endpoint": str,
    "topic": str,
    "encoding": str,
}
_COUNTS = ("buffer_steps", "hwm", "max_queue_size")
# ZMQ takes a high-water mark as a C int, and the replay socket's is twice buffer_steps.
MAX_COUNT = 2**30 - 1
# inproc:// reaches only sockets in this process: no router could subscribe.
_SCHEMES = ("tcp://", "ipc://")


def parse_kv_events_config(text: str) -> KVEventsConfig:
    """The JSON object of ``--kv-events-config``; ValueError says what is wrong with it."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(obj, dict):
        raise ValueError("expected a JSON object, e.g. '{\"enable_kv_cache_events\": true}'")
    known = [f.name for f in fields(KVEventsConfig)]
    unknown = sorted(set(obj) - set(known))
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r} (the keys are {', '.join(known)})")
    for key, value in obj.items():
        _check_value(key, value)
    config = KVEventsConfig(**obj)
    if _same_address(config.endpoint, config.replay_endpoint):
        # Bound twice, the replay socket would take the address (an ipc file is replaced)
        # and subscribers would receive nothing.
        raise ValueError(
            f"endpoint and replay_endpoint name one address ({config.replay_endpoint}): "
            "give each its own"
        )
    if config.publisher is None:  # vLLM's default: zmq once events are on
        config = replace(config, publisher="zmq" if config.enable_kv_cache_events else "null")
    return config


def _check_value(key: str, value: Any) -> None:
    if key in _TYPES:
        if not isinstance(value, _TYPES[key]) and not (key == "publisher" and value is None):
            raise ValueError(f"{key} must be a {_TYPES[key].__name__}, got {value!r}")
        if key == "publisher" and value not in (None, "zmq", "null"):
            raise ValueError(f"unknown publisher {value!r} (choose from zmq, null)")
        if key == "encoding" and value not in ENCODINGS:
            raise ValueError(f"unknown encoding {value!r} (choose from {', '.join(ENCODINGS)})")
        if isinstance(value, str) and not _encodable(value):
            raise ValueError(f"{key} must be valid UTF-8 text (it has a lone surrogate)")
    elif key in _COUNTS:
        if type(value) is not int or not 1 <= value <= MAX_COUNT:
            shown = value if len(repr(value)) <= 40 else f"{repr(value)[:20]}..."
            raise ValueError(f"{key} must be a whole number from 1 to {MAX_COUNT:,}, got {shown}")
    if key in ("endpoint", "replay_endpoint") and value is not None:
        _check_endpoint(key, value)


def _same_address(endpoint: str, replay: str | None) -> bool:
    """Whether two endpoints would bind one address (a wildcard port picks two free ones)."""
    if replay is None or endpoint.endswith(":*"):
        return False
    if endpoint.startswith("ipc://") and replay.startswith("ipc://"):
        paths = (endpoint.removeprefix("ipc://"), replay.removeprefix("ipc://"))
        return os.path.realpath(paths[0]) == os.path.realpath(paths[1])
    return endpoint == replay


def _encodable(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _check_endpoint(key: str, value: Any) -> None:
    """A ZMQ address another process can reach: tcp://HOST:PORT (PORT 1-65535, or * for any
    free one) or ipc://PATH."""
    example = "like tcp://*:5557 or ipc:///tmp/kv-events"
    if not isinstance(value, str) or not value.startswith(_SCHEMES) or not _encodable(value):
        if isinstance(value, str) and value.startswith("inproc://"):
            raise ValueError(f"{key} {value}: inproc:// reaches no other process ({example})")
        raise ValueError(f"{key} must be a ZMQ address {example}, got {value!r}")
    if value.startswith("tcp://"):
        host, _, port = value.removeprefix("tcp://").rpartition(":")
        if not host or not (port == "*" or (port.isdigit() and 1 <= int(port) <= 65535)):
            raise ValueError(f"{key} {value}: the port must be 1-65535 or * ({example})")
    elif value == "ipc://":
        raise ValueError(f"{key} {value}: an ipc address needs a path ({example})")


# -- the publisher -------------------------------------------------------------------------------


class ZmqKVEventPublisher:
    """vLLM's reliable PUB/ROUTER publisher with a replay buffer, fed by the engine's events.

    The engine thread only sorts events into batches (``__call__``) and hands each closed batch
    to a queue without waiting; a thread of its own encodes, numbers, sends and buffers them,
    and answers replays. A full queue (the thread starved for ``max_queue_size`` steps) drops
    the batch rather than stall the engine, and the next batch resends everything a consumer
    should hold, after a clear. The PUB socket never blocks either: past ``hwm`` messages
    queued for a slow subscriber, it drops them (the subscriber sees the gap and replays).
    """

    LINGER_MS = 1000  # on close: time to deliver the last batches to connected subscribers

    def __init__(self, config: KVEventsConfig, block_size: int) -> None:
        import zmq

        self.config = config
        self.batcher = KVEventBatcher(block_size)
        self.dropped = 0  # batches the queue had no room for
        self._resync = False
        self._first = True
        self._closed = False
        self._queue: queue.Queue[tuple[float, list] | None] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._replays: dict[bytes, int] = {}  # peer -> the start it asked for, oldest first
        self._ctx = zmq.Context()
        try:
            self._pub, self.endpoint = self._open_pub(zmq)
            self._replay, self.replay_endpoint = self._open_replay(zmq)
        except BaseException:
            self._ctx.destroy(linger=0)
            raise
        self._thread = threading.Thread(target=self._run, name="nanokv-kv-events", daemon=True)
        self._thread.start()

    def _open_pub(self, zmq) -> tuple[Any, str]:
        sock = self._ctx.socket(zmq.PUB)
        sock.setsockopt(zmq.SNDHWM, self.config.hwm)
        sock.setsockopt(zmq.LINGER, self.LINGER_MS)
        ep = self.config.endpoint
        # vLLM's rule: bind a wildcard (and ipc/inproc), connect to anything else.
        if "*" in ep or "::" in ep or ep.startswith(("ipc://", "inproc://")):
            _bind(sock, ep, "endpoint")
            return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)
        sock.connect(ep)
        return sock, ep

    def _open_replay(self, zmq) -> tuple[Any, str | None]:
        ep = self.config.replay_endpoint
        if ep is None:
            return None, None
        sock = self._ctx.socket(zmq.ROUTER)
        # A replay sends the whole buffer at most. A ROUTER drops what exceeds its high-water
        # mark, which counts a reader's progress only every half mark: twice the buffer is
        # room for a whole replay to a client that reads (libzmq's default, 1000, is not).
        sock.setsockopt(zmq.SNDHWM, min(2 * (self.config.buffer_steps + 1), 2**31 - 1))
        sock.setsockopt(zmq.LINGER, 0)
        _bind(sock, ep, "replay_endpoint")
        return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)

    # The engine thread.
    def __call__(self, event: Event) -> None:
        events = self.batcher.feed(event)
        if events is not None:
            self._hand_over(events)

    def _hand_over(self, events: list[list[Any]]) -> None:
        if self._resync:
            events = self.batcher.resync()  # includes this step: it is already in the books
        elif self._first:
            events = [CLEARED, *events]
        try:
            self._queue.put_nowait((time.time(), events))
        except queue.Full:
            self.dropped += 1
            self._resync = True
            return
        self._first = self._resync = False

    def close(self) -> None:
        """Send what is left of the step in progress and a final clear (the cache goes with
        the process), wait for the thread to send everything, and close the sockets. Once."""
        if self._closed:
            return
        self._closed = True
        rest = self.batcher.take()
        if rest and not self._resync:
            self._hand_over(rest)
        # The clear leaves a consumer holding nothing, whatever it missed: worth a short wait.
        try:
            self._queue.put((time.time(), [CLEARED]), timeout=10)
            self._queue.put(None, timeout=10)
        except queue.Full:  # the thread died and the queue filled: nothing left to wait for
            return
        self._thread.join(timeout=10)

    # The publisher thread: every socket is used here only.
    def _run(self) -> None:
        seq = 0
        topic = self.config.topic.encode()
        try:
            while True:
                waiting = self._replay is not None and self._serve_replays()
                try:  # replays still waiting: take a live batch if there is one, not a nap
                    item = self._queue.get_nowait() if waiting else self._queue.get(timeout=0.02)
                except queue.Empty:
                    continue
                if item is None:
                    break
                payload = encode_batch(*item, self.config.encoding)
                seq_bytes = seq.to_bytes(8, "big")
                self._pub.send_multipart((topic, seq_bytes, payload), copy=False)
                self._buffer.append((seq, payload))
                seq += 1
        except Exception:  # a bug here must not take the server down: stop publishing
            log.exception("nanokv: the KV event publisher stopped")
        finally:
            self._ctx.destroy(linger=self.LINGER_MS)

    def _serve_replays(self) -> bool:
        """Read a few replay requests, then answer one (as vLLM's publisher does): a live
        batch goes out between any two replays, however many are asked for. A peer has one
        request waiting at most; what it asks again meanwhile is dropped, so a flood from one
        peer neither grows the books nor delays the others. Whether requests still wait."""
        self._read_replay_requests()
        if not self._replays:
            return False
        client = next(iter(self._replays))  # the longest waiting
        start = self._replays.pop(client)
        for seq, payload in self._buffer:
            if seq >= start:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_OF_REPLAY, b""))
        return bool(self._replays) or bool(self._replay.poll(0))

    def _read_replay_requests(self) -> None:
        import zmq

        for _ in range(REPLAY_READS_PER_TURN):  # the rest wait in the socket, bounded by its HWM
            if not self._replay.poll(0):
                return
            frames = self._replay.recv_multipart(zmq.NOBLOCK)
            # [identity, b"", start_seq]: from a REQ socket, or a DEALER that adds the b"".
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                log.warning("nanokv: ignored a malformed KV event replay request")
                continue
            self._replays.setdefault(frames[0], int.from_bytes(frames[2], "big"))


def _bind(sock, endpoint: str, key: str) -> None:
    import zmq

    try:
        sock.bind(endpoint)
    except zmq.ZMQError as e:
        raise OSError(e.errno, f"--kv-events-config {key} {endpoint}: {e.strerror}") from None


@contextmanager
def publish_kv_events(engine, config: KVEventsConfig) -> Iterator[ZmqKVEventPublisher | None]:
    """Publish ``engine``'s KV events as ``config`` says while the block runs (nothing if it
    is off); on exit the publisher flushes and closes."""
    if not config.enabled:
        yield None
        return
    publisher = ZmqKVEventPublisher(config, engine.block_size)
    unsubscribe = engine.events.subscribe(publisher)
    try:
        yield publisher
    finally:
        unsubscribe()
        publisher.close()


def publishing_note(publisher: ZmqKVEventPublisher | None) -> str:
    """The line ``serve`` prints: where the events go (the bound addresses, ports resolved)."""
    if publisher is None:
        return "nanokv: KV events are off (enable_kv_cache_events is false, or publisher null)"
    replay = publisher.replay_endpoint
    more = f", replay on {replay}" if replay else ", no replay endpoint"
    return f"nanokv: KV events on {publisher.endpoint} (topic {publisher.config.topic!r}{more})"
