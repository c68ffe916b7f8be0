"""KV events for routers: vLLM's wire format (kv_events.py), published by ``nanokv serve
--kv-events-config``, read by real pyzmq sockets and by NVIDIA Dynamo's standalone KV indexer
(``python -m dynamo.indexer``, from ai-dynamo-runtime), and checked against nanokv's own books:
the engine's block manager, the server's trace, and the cached tokens the server reports."""

from __future__ import annotations

import io
import json
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import msgpack
import msgspec
import pytest
import zmq
from support.engines import dry_engine
from support.servers import LOOPBACK

from nanokv_cli.cli import app
from nanokv_cli.engine.core.blocks import hash_block_tokens
from nanokv_cli.engine.core.events import BlockStored
from nanokv_cli.engine.core.llm_engine import LLMEngine
from nanokv_cli.engine.sampling_params import SamplingParams
from nanokv_cli.kv_events import (
    KVEventBatcher,
    KVEventsConfig,
    ZmqKVEventPublisher,
    encode_batch,
    parse_kv_events_config,
)
from nanokv_cli.serve.process import ServerProcess
from nanokv_cli.trace.exporter import export
from nanokv_cli.trace.format import make_header
from nanokv_cli.trace.reader import TraceReader
from nanokv_cli.trace.writer import TraceWriter

BS = 16


# -- vLLM's structs, as vllm/distributed/kv_events.py declares them -----------------------------
# Today's encoding (vLLM PR #42892 on): each event a map tagged by "type", field by field as
# vLLM's current classes; unknown fields refused, so nanokv sends nothing vLLM does not name.


class KVCacheEvent(
    msgspec.Struct, omit_defaults=True, gc=False, tag=True, forbid_unknown_fields=True
):
    pass


class BlockStoredWire(KVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[int] | None = None


class BlockRemovedWire(KVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksClearedWire(KVCacheEvent, tag="AllBlocksCleared"):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStoredWire | BlockRemovedWire | AllBlocksClearedWire]
    data_parallel_rank: int | None = None


# The older encoding: each event a tagged array, in vLLM's field order.


class ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStoredArray(ArrayEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemovedArray(ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class AllBlocksClearedArray(ArrayEvent, tag="AllBlocksCleared"):
    pass


class KVEventBatchArray(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStoredArray | BlockRemovedArray | AllBlocksClearedArray]
    data_parallel_rank: int | None = None


DECODERS = {
    "map": msgspec.msgpack.Decoder(KVEventBatch),
    "array": msgspec.msgpack.Decoder(KVEventBatchArray),
}
DECODER = DECODERS["map"]
STORED, REMOVED = (BlockStoredWire, BlockStoredArray), (BlockRemovedWire, BlockRemovedArray)
CLEARED = (AllBlocksClearedWire, AllBlocksClearedArray)


def canonical(event) -> tuple:
    """What an event says, whichever encoding carried it."""
    if isinstance(event, STORED):
        return ("stored", *event.block_hashes, event.parent_block_hash, tuple(event.token_ids))
    if isinstance(event, REMOVED):
        return ("removed", *event.block_hashes)
    return ("cleared",)


class Held:
    """What a consumer of one stream holds: the announced hashes, applied batch by batch, with
    the stream's own rules checked on the way (no hash announced twice, none removed unheld,
    every parent held, every hash the chained hash of its tokens)."""

    def __init__(self) -> None:
        self.hashes: set[int] = set()
        self.removed = 0

    def apply(self, batch: KVEventBatch | KVEventBatchArray) -> None:
        assert batch.data_parallel_rank == 0 and batch.ts > 0
        for e in batch.events:
            if isinstance(e, CLEARED):
                self.hashes.clear()
            elif isinstance(e, REMOVED):
                (h,) = e.block_hashes
                assert h in self.hashes, f"BlockRemoved of {h}, never announced"
                self.hashes.remove(h)
                self.removed += 1
                assert e.medium is None and getattr(e, "group_idx", 0) == 0
            else:
                (h,) = e.block_hashes
                assert h not in self.hashes, f"BlockStored of {h} twice"
                assert e.parent_block_hash is None or e.parent_block_hash in self.hashes
                assert e.block_size == BS and len(e.token_ids) == BS
                assert e.lora_id is e.medium is e.lora_name is None
                if isinstance(e, BlockStoredWire):  # one group of full attention, no extra keys
                    assert (e.group_idx, e.kv_cache_spec_kind) == (0, "full_attention")
                    assert e.extra_keys == [None]
                parent = -1 if e.parent_block_hash is None else e.parent_block_hash
                assert hash_block_tokens(e.token_ids, parent) == h
                self.hashes.add(h)

    def leading_blocks(self, tokens: list[int]) -> int:
        """How many of ``tokens``' full blocks, from the first on, this consumer holds."""
        n, parent = 0, -1
        for i in range(len(tokens) // BS):
            parent = hash_block_tokens(tokens[i * BS : (i + 1) * BS], parent)
            if parent not in self.hashes:
                break
            n += 1
        return n


class Stream:
    """A SUB socket on a publisher plus a DEALER on its replay socket (the frames Dynamo's
    indexer sends: ``[b"", start_seq]``), kept gap-free: a batch missed by the SUB (it joined
    late) is fetched by replay before the next is applied."""

    def __init__(
        self, ctx: zmq.Context, endpoint: str, replay_endpoint: str, encoding: str = "map"
    ) -> None:
        self.decoder = DECODERS[encoding]
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.dealer = ctx.socket(zmq.DEALER)
        self.dealer.connect(replay_endpoint)
        self.frames: list[tuple[int, bytes]] = []  # every batch in order, from seq 0
        self.live = 0  # of them received by the SUB (the rest by replay)
        self.held = Held()

    def replay(self, start: int) -> list[tuple[int, bytes]]:
        self.dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            assert self.dealer.poll(10_000), "no answer to a replay request"
            empty, seq, payload = self.dealer.recv_multipart()
            assert empty == b""
            if payload == b"":
                assert int.from_bytes(seq, "big", signed=True) == -1
                return out
            out.append((int.from_bytes(seq, "big"), payload))

    def update(self, quiet: float = 0.3) -> None:
        """Take every batch published so far (the publisher has been quiet for ``quiet`` s)."""
        while self.sub.poll(int(quiet * 1000)):
            topic, seq_bytes, payload = self.sub.recv_multipart()
            assert topic == b"kv-events" and len(seq_bytes) == 8
            seq = int.from_bytes(seq_bytes, "big")
            if seq > len(self.frames):
                missed = [f for f in self.replay(len(self.frames)) if f[0] < seq]
                for f in missed:
                    self._apply(*f)
            self._apply(seq, payload)
            self.live += 1

    def _apply(self, seq: int, payload: bytes) -> None:
        assert seq == len(self.frames), f"sequence number {seq} after {len(self.frames) - 1}"
        self.frames.append((seq, payload))
        self.held.apply(self.decoder.decode(payload))

    def close(self) -> None:
        self.sub.close(linger=0)
        self.dealer.close(linger=0)


def kv_events_args(**extra) -> list[str]:
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": LOOPBACK,
        "replay_endpoint": LOOPBACK,
        "topic": "kv-events",
        **extra,
    }
    return ["--kv-events-config", json.dumps(config)]


def endpoints(server: ServerProcess) -> tuple[str, str]:
    line = next(x for x in server.log().splitlines() if "KV events on" in x)
    words = line.replace(")", "").split()
    return words[words.index("on") + 1], words[-1]


def complete(server: ServerProcess, tokens: list[int], max_tokens: int = 4) -> int:
    """Send one greedy completion; the prompt tokens it found cached (the server's books)."""
    body = {"prompt": tokens, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def prompt(rng: random.Random, prefix: list[int], blocks: int) -> list[int]:
    """``prefix`` then random tokens, ``blocks`` full blocks and one token more: every full
    block counts in a lookup (the block holding the last token never does)."""
    n = blocks * BS + 1 - len(prefix)
    return prefix + [rng.randrange(3, 320) for _ in range(n)]


def start(tiny: Path, workdir: Path, *extra: str, encoding: str = "map") -> ServerProcess:
    workdir.mkdir(parents=True, exist_ok=True)
    args = ["--model", str(tiny), "--block-size", str(BS), "--num-blocks", "24", "--threads", "1"]
    events = kv_events_args(encoding=encoding)
    return ServerProcess([*args, "--no-live", *events, *extra], workdir, {"OMP_NUM_THREADS": "1"})


def stop(server: ServerProcess) -> None:
    server.proc.send_signal(signal.SIGTERM)
    assert server.wait() == 0, server.log()


# -- the setting ------------------------------------------------------------------------------


def test_the_setting_takes_vllms_keys_and_refuses_anything_else():
    config = parse_kv_events_config('{"enable_kv_cache_events": true, "topic": "kv"}')
    assert config.enabled and config.publisher == "zmq" and config.topic == "kv"
    assert (config.endpoint, config.replay_endpoint) == ("tcp://*:5557", None)
    assert (config.buffer_steps, config.hwm) == (10_000, 100_000)  # vLLM's defaults
    assert config.encoding == "map"  # vLLM's today
    assert parse_kv_events_config('{"encoding": "array"}').encoding == "array"
    assert not parse_kv_events_config('{"enable_kv_cache_events": false}').enabled
    null = '{"enable_kv_cache_events": true, "publisher": "null"}'
    assert not parse_kv_events_config(null).enabled
    from typer.testing import CliRunner

    for bad, says in [
        ("{nope", "not JSON"),
        ("[1]", "expected a JSON object"),
        ('{"enable_kv_cache_events": true, "endpont": "tcp://*:1"}', "unknown key 'endpont'"),
        ('{"publisher": "kafka"}', "unknown publisher 'kafka'"),
        ('{"hwm": 0}', "hwm must be a whole number"),
        ('{"enable_kv_cache_events": "yes"}', "must be a bool"),
        ('{"endpoint": "localhost:5557"}', "must be a ZMQ address"),
        ('{"encoding": "tuple"}', "unknown encoding 'tuple' (choose from map, array)"),
        # Accepted once, then wrong or a crash (issue #49, items 11, 12, 16 and 24):
        ('{"endpoint": "tcp://*:99999"}', "the port must be 1-65535 or *"),
        ('{"endpoint": "tcp://*:0"}', "the port must be 1-65535 or *"),
        ('{"endpoint": "inproc://kv"}', "inproc:// reaches no other process"),
        ('{"endpoint": "ipc:///tmp/kv", "replay_endpoint": "ipc:///tmp/./kv"}', "one address"),
        ('{"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5557"}', "one address"),
        ('{"hwm": 99999999999999999999999}', "hwm must be a whole number from 1 to"),
        ('{"buffer_steps": 2147483648}', "buffer_steps must be a whole number from 1 to"),
        ('{"topic": "kv\\ud800"}', "topic must be valid UTF-8 text"),
    ]:
        result = CliRunner().invoke(app, ["serve", "--kv-events-config", bad])
        assert result.exit_code == 2, result.output
        text = " ".join(result.output.replace("│", " ").split())  # unboxed: one line
        assert "Invalid value for '--kv-events-config'" in text and says in text, text


def test_the_largest_counts_the_setting_takes_start_a_publisher():
    top = 2**30 - 1
    text = json.dumps(
        {
            "enable_kv_cache_events": True,
            "endpoint": LOOPBACK,
            "replay_endpoint": LOOPBACK,
            **{key: top for key in ("buffer_steps", "hwm", "max_queue_size")},
        }
    )
    publisher = ZmqKVEventPublisher(parse_kv_events_config(text), BS)  # no OverflowError
    try:
        assert publisher.endpoint != publisher.replay_endpoint  # two wildcard ports: two ports
    finally:
        publisher.close()


def test_a_taken_endpoint_is_a_clear_error():
    taken = zmq.Context.instance().socket(zmq.PUB)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    try:
        config = KVEventsConfig(True, "zmq", f"tcp://*:{port}")
        with pytest.raises(OSError, match=f"endpoint tcp://\\*:{port}: Address already in use"):
            ZmqKVEventPublisher(config, BS)
    finally:
        taken.close(linger=0)


# -- the batches, against the engine's books --------------------------------------------------


def workload(eng: LLMEngine, on_step) -> None:
    """Repeated prompts (whose last block is recomputed: a duplicate), shared prefixes and a
    cache small enough to evict."""
    rng = random.Random(1)
    shared = [rng.randrange(3, 320) for _ in range(2 * BS)]
    prompts = [shared + [rng.randrange(3, 320) for _ in range(BS)] for _ in range(3)]
    prompts += [prompts[0], [rng.randrange(3, 320) for _ in range(5 * BS + 3)], prompts[1]]
    for p in prompts:
        eng.add_request(p, SamplingParams(max_tokens=BS + 3, ignore_eos=True))
        while eng.has_unfinished_requests():
            eng.step()
            on_step()


def test_each_step_announces_what_the_prefix_cache_holds_once():
    eng = dry_engine(12, BS, vocab_size=None)
    batcher, held, raw_stores = KVEventBatcher(BS), Held(), []
    step_batches = []

    def listen(event):
        if type(event) is BlockStored:
            raw_stores.append(event.block_hash)
        events = batcher.feed(event)
        if events is not None:
            step_batches.append(events)

    eng.events.subscribe(listen)

    def check():
        while step_batches:
            events = step_batches.pop(0)
            batches = {e: DECODERS[e].decode(encode_batch(1.0, events, e)) for e in DECODERS}
            says = {e: [canonical(x) for x in b.events] for e, b in batches.items()}
            assert says["map"] == says["array"]  # two encodings of one batch
            held.apply(batches["map"])
        assert held.hashes == set(eng.block_manager.hash_to_block_id)

    workload(eng, check)
    assert len(raw_stores) > len(set(raw_stores)), "the workload stored no duplicate"
    assert held.removed > 0, "the workload evicted nothing"
    assert set(batcher.announced) == held.hashes


def test_the_file_export_is_the_stream_the_publisher_sends(tmp_path):
    """One encoding: ``inspect --export vllm-kv-events`` writes the publisher's batches (which
    add a clear first and last: the cache's start and end)."""
    eng = dry_engine(12, BS, vocab_size=None)
    config = KVEventsConfig(True, "zmq", LOOPBACK, LOOPBACK, buffer_steps=4, topic="kv-events")
    publisher = ZmqKVEventPublisher(config, BS)
    stream = Stream(zmq.Context.instance(), publisher.endpoint, publisher.replay_endpoint)
    try:
        time.sleep(0.5)  # the SUB's subscription reaches the publisher before the first batch
        path = tmp_path / "run.trace"
        header = make_header(block_size=BS, num_blocks=12, model=None, dry_run=True)
        with TraceWriter(path, header) as writer:
            eng.events.subscribe(writer)
            eng.events.subscribe(publisher)
            workload(eng, lambda: None)
        stream.update()
        n = len(stream.frames)
        assert n > 4 and stream.live == n
        # A bounded buffer: the last 4 batches, byte for byte, then the end marker.
        assert stream.replay(0) == stream.frames[-4:] == stream.replay(n - 4)
        # A malformed request is ignored; the next one is still answered.
        stream.dealer.send_multipart([b"", b"\x01"])
        assert stream.replay(n - 1) == stream.frames[-1:]
        publisher.close()
        stream.update()
        (last,) = [DECODER.decode(p) for _, p in stream.frames[n:]]
        assert last.events == [AllBlocksClearedWire()] and stream.held.hashes == set()
    finally:
        publisher.close()  # again after a failure: stops the thread
        stream.close()
    published = [DECODER.decode(p).events for _, p in stream.frames[:n]]
    assert published[0][0] == AllBlocksClearedWire()
    for fmt, encoding in (("vllm-kv-events", "map"), ("vllm-kv-events-array", "array")):
        out = io.BytesIO()
        assert export(TraceReader(path), fmt, out) == n
        exported = [
            DECODERS[encoding].decode(msgpack.packb(b)).events
            for b in msgpack.Unpacker(io.BytesIO(out.getvalue()))
        ]
        if encoding == "map":
            assert exported == [published[0][1:], *published[1:]]
        said = [[canonical(e) for e in batch] for batch in exported]
        assert said == [[canonical(e) for e in b] for b in [published[0][1:], *published[1:]]]


# -- a real server ----------------------------------------------------------------------------


def test_a_server_publishes_every_cache_change_in_order_and_replays_it(tiny, tmp_path):
    trace = tmp_path / "serve.trace"
    server = start(tiny, tmp_path / "server", "--record", str(trace))
    stream = Stream(zmq.Context.instance(), *endpoints(server))
    try:
        rng = random.Random(7)
        system = prompt(rng, [], 3)[: 3 * BS]
        cached = 0
        for i in range(8):  # 6-block prompts, 3 blocks shared, in a 24-block cache: evictions
            cached += complete(server, prompt(rng, system if i % 2 else [], 6), max_tokens=BS)
        stream.update()
        frames = list(stream.frames)
        assert stream.live > 0 and stream.held.removed > 0 and cached > 0
        # Replay from any sequence number gives the same batches, byte for byte.
        assert stream.replay(0) == frames
        assert stream.replay(len(frames) // 2) == frames[len(frames) // 2 :]
        first = DECODER.decode(frames[0][1]).events
        assert first[0] == AllBlocksClearedWire() and isinstance(first[1], BlockStoredWire)
        held = set(stream.held.hashes)
    finally:
        server.proc.send_signal(signal.SIGTERM)
        code = server.wait()
    assert code == 0, server.log()
    stream.update()
    (last,) = [DECODER.decode(p) for _, p in stream.frames[len(frames) :]]
    assert last.events == [AllBlocksClearedWire()]  # the cache leaves with the process
    stream.close()
    books = TraceReader(trace).state_at()  # the server's own record of its cache
    assert held == {h for h in books.block_hash if h != -1}


# -- Dynamo's indexer, subscribed to two servers ------------------------------------------------


MODEL = "nanokv-tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Indexer:
    """``python -m dynamo.indexer``: registers workers over HTTP and answers ``/query`` with
    each worker's overlap (in tokens) for a prompt, computed from its own block keys."""

    def __init__(self, workdir: Path) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log_path = workdir / "indexer.log"
        cmd = [sys.executable, "-m", "dynamo.indexer", "--port", self.url.rsplit(":", 1)[1]]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen([*cmd, "--threads", "1"], stdout=log, stderr=log)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                httpx.get(f"{self.url}/workers", timeout=5)
                return
            except httpx.TransportError:
                time.sleep(0.05)
        raise AssertionError(f"the indexer did not start:\n{self.log_path.read_text()}")

    def register(self, worker: int, server: ServerProcess) -> None:
        endpoint, replay = endpoints(server)
        body = {"instance_id": worker, "endpoint": endpoint, "replay_endpoint": replay}
        r = httpx.post(f"{self.url}/register", json={**body, "model_name": MODEL, "block_size": BS})
        assert r.status_code == 201, r.text

    def unregister(self, worker: int) -> None:
        r = httpx.post(f"{self.url}/unregister", json={"instance_id": worker, "model_name": MODEL})
        assert r.status_code == 200, r.text

    def overlap(self, tokens: list[int]) -> dict[int, int]:
        """Blocks of ``tokens`` each worker holds, by the indexer (workers holding none absent)."""
        r = httpx.post(f"{self.url}/query", json={"token_ids": tokens, "model_name": MODEL})
        assert r.status_code == 200, r.text
        scores = r.json()["scores"]
        return {int(w): ranks["0"] // BS for w, ranks in scores.items() if ranks.get("0")}

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


def converge(indexer: Indexer, streams: dict[int, Stream], prompts: list[list[int]]) -> dict:
    """Wait until the indexer's overlaps equal what each stream announced; assert they do."""

    def views():
        for s in streams.values():
            s.update(quiet=0.1)
        ours = [{w: s.held.leading_blocks(p) for w, s in streams.items()} for p in prompts]
        theirs = [indexer.overlap(p) for p in prompts]
        return [{w: n for w, n in o.items() if n} for o in ours], theirs

    deadline = time.monotonic() + 15
    ours, theirs = views()
    while ours != theirs and time.monotonic() < deadline:
        time.sleep(0.1)
        ours, theirs = views()
    assert ours == theirs, f"nanokv announced {ours}, the indexer holds {theirs}"
    return ours


def attach(
    indexer: Indexer, worker: int, server: ServerProcess, rng: random.Random, encoding: str
) -> Stream:
    """Register ``server`` and wait until the indexer's subscription is live: a fresh prompt
    (its own first token: no test prompt shares a block with it) shows up in its answers."""
    stream = Stream(zmq.Context.instance(), *endpoints(server), encoding=encoding)
    indexer.register(worker, server)
    for _ in range(50):
        probe = prompt(rng, [1], 2)
        complete(server, probe, max_tokens=1)
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            if indexer.overlap(probe).get(worker):
                return stream
            time.sleep(0.05)
    raise AssertionError("the indexer never received a batch")


def books_agree(server: ServerProcess, stream: Stream, tokens: list[int]) -> None:
    """The server's own lookup of ``tokens`` finds the blocks its stream announced."""
    stream.update()
    assert complete(server, tokens, max_tokens=1) // BS == stream.held.leading_blocks(tokens)


@pytest.mark.slow
@pytest.mark.parametrize("encoding", ["map", "array"])
def test_dynamos_indexer_holds_per_server_what_each_server_holds(encoding, tiny, tmp_path):
    pytest.importorskip("dynamo.indexer", reason="ai-dynamo-runtime (the test extra) is missing")
    rng = random.Random(3)
    indexer = Indexer(tmp_path)
    servers = []
    try:
        a = start(tiny, tmp_path / "a", encoding=encoding)
        servers.append(a)
        b = start(tiny, tmp_path / "b", encoding=encoding)
        servers.append(b)
        streams = {1: attach(indexer, 1, a, rng, encoding), 2: attach(indexer, 2, b, rng, encoding)}
        s1, s2 = prompt(rng, [], 3)[: 3 * BS], prompt(rng, [], 2)[: 2 * BS]
        prompts = [prompt(rng, s1, 5), prompt(rng, s1, 5), prompt(rng, s2, 4), prompt(rng, s2, 4)]
        for p in prompts[:3]:
            complete(a, p)
        for p in [prompts[3], prompts[0]]:
            complete(b, p)
        before = converge(indexer, streams, prompts)
        assert before == [{1: 5, 2: 5}, {1: 5, 2: 3}, {1: 4, 2: 2}, {1: 2, 2: 4}]
        books_agree(a, streams[1], prompts[1])
        books_agree(b, streams[2], prompts[2])

        for _ in range(4):  # A's cache turns over: the shared prefix is evicted
            complete(a, prompt(rng, [2], 6), max_tokens=BS)
        evicted = converge(indexer, streams, prompts)
        assert evicted[0].get(1, 0) < 5 and evicted[0][2] == 5
        books_agree(a, streams[1], prompts[0])

        # Ctrl-C stops A: its last batch, AllBlocksCleared, empties its share of the index.
        a.proc.send_signal(signal.SIGINT)
        assert a.wait() == 130, a.log()
        servers.remove(a)
        streams.pop(1).close()
        gone = converge(indexer, {2: streams[2]}, prompts)
        assert all(1 not in o for o in gone) and gone[3] == {2: 4}
        # A restarts with an empty cache. Dynamo's ZMQ listener does not reconnect to a
        # restarted publisher: the worker is registered again, as Dynamo's discovery would.
        a = start(tiny, tmp_path / "a2", encoding=encoding)
        servers.append(a)
        indexer.unregister(1)
        streams[1] = attach(indexer, 1, a, rng, encoding)
        complete(a, prompts[2])
        after = converge(indexer, streams, prompts)
        assert 1 not in after[0] and after[2][1] == 4
        books_agree(a, streams[1], prompts[2])
    finally:
        indexer.stop()
        for server in servers:
            server.proc.send_signal(signal.SIGTERM)
        codes = [server.wait() for server in servers]
    assert codes == [0] * len(servers), [server.log() for server in servers]
