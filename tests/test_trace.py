"""Event traces (version 2): every event read back, any step rebuilt through a checkpoint, torn
and damaged files refused or cut cleanly, version 1 still read, vLLM's KV events exported."""

from __future__ import annotations

import copy
import io
import json

import msgpack
import msgspec
import pytest
from support.engines import books

from nanokv_cli.engine.config import EngineConfig
from nanokv_cli.engine.core.dry_run import DryRunExecutor, VirtualClock
from nanokv_cli.engine.core.events import BlockStored as EngineBlockStored
from nanokv_cli.engine.core.events import CacheState, StepSnapshot, event_to_dict
from nanokv_cli.engine.core.llm_engine import LLMEngine
from nanokv_cli.engine.core.requests import Request, all_at_once
from nanokv_cli.engine.sampling_params import SamplingParams
from nanokv_cli.run.analysis import describe_state
from nanokv_cli.run.loop import Arrivals, Driver
from nanokv_cli.trace import format as trace_format
from nanokv_cli.trace import writer
from nanokv_cli.trace.exporter import export
from nanokv_cli.trace.format import TRACE_VERSION, TraceError, make_header
from nanokv_cli.trace.reader import TraceReader
from nanokv_cli.trace.writer import TraceWriter
from nanokv_cli.workload.mooncake import SynthesizedPrompt

BLOCK_SIZE, NUM_BLOCKS = 4, 24


def as_json(event) -> dict:
    return json.loads(json.dumps(event_to_dict(event)))


def engine(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE) -> LLMEngine:
    clock = VirtualClock()
    settings = EngineConfig(num_blocks=num_blocks, block_size=block_size)
    return LLMEngine(DryRunExecutor(settings, clock=clock), settings, clock=clock)


def run_shared_prefix_workload(eng: LLMEngine, on_step=None) -> None:
    """Requests that share a 12-token prefix, arriving a step apart; a small cache evicts."""
    prefix = list(range(100, 112))
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    for i in range(8):
        eng.add_request(prefix + [i] * (3 + i), params)
        eng.step()
        if on_step:
            on_step()
    while eng.has_unfinished_requests():
        eng.step()
        if on_step:
            on_step()


@pytest.fixture
def small_records(monkeypatch):
    """Checkpoints every 3 steps and a record per step or two: every path gets exercised."""
    monkeypatch.setattr(writer, "CHECKPOINT_EVERY", 3)
    monkeypatch.setattr(writer, "FLUSH_STEPS", 2)


def record(tmp_path, on_step=None):
    eng = engine()
    path = tmp_path / "run.trace"
    seen = []
    eng.events.subscribe(seen.append)
    header = make_header(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, model=None, dry_run=True)
    with TraceWriter(path, header) as writer:
        eng.events.subscribe(writer)
        run_shared_prefix_workload(eng, on_step=(lambda: on_step(path)) if on_step else None)
    return path, seen


def live_states(seen):
    live = CacheState(NUM_BLOCKS)
    expected = {}
    for event in seen:
        live.apply(event)
        if type(event) is StepSnapshot:
            expected[event.step] = copy.deepcopy(
                (
                    live.ref_count,
                    live.block_hash,
                    live.block_tables,
                    {b: list(t) for b, t in live.block_tokens.items()},
                    {s: list(p) for s, p in live.prompts.items()},
                )
            )
    return expected


def test_header_and_every_event_read_back(tmp_path, small_records):
    path, seen = record(tmp_path)
    assert path.read_bytes()[:8] == trace_format.MAGIC
    reader = TraceReader(path)
    assert reader.header["format"] == "nanokv-trace" and reader.header["version"] == TRACE_VERSION
    assert reader.block_size == BLOCK_SIZE and reader.num_blocks == NUM_BLOCKS
    assert [as_json(e) for e in reader.events()] == [as_json(e) for e in seen]
    kinds = {r[0] for r in reader.records}
    assert kinds == {b"H", b"P", b"E", b"C"}


def test_state_at_each_step_matches_the_live_state(tmp_path, small_records):
    path, seen = record(tmp_path)
    expected = live_states(seen)
    reader = TraceReader(path)
    assert any(rc > 1 for rc, *_ in expected.values() for rc in rc), "workload should share"
    for step, books_then in expected.items():
        state = reader.state_at(step)
        assert books(state) == books_then, step
        assert state.last_snapshot.step == step
    last = max(expected)
    assert reader.state_at().last_snapshot.step == last
    with pytest.raises(TraceError, match=f"no step {last + 1}; the trace has steps up to {last}"):
        reader.state_at(last + 1)


def test_prompt_tokens_are_stored_once(tmp_path):
    """A stored block of prompt tokens names its sequence instead of repeating them."""
    eng = engine(num_blocks=256, block_size=4)
    path = tmp_path / "t.trace"
    prompt = list(range(1000, 1400))  # 100 full blocks
    with TraceWriter(path, make_header(block_size=4, num_blocks=256, model=None)) as writer:
        eng.events.subscribe(writer)
        eng.add_request(prompt, SamplingParams(max_tokens=2, ignore_eos=True))
        while eng.has_unfinished_requests():
            eng.step()
    items = [
        item
        for r in TraceReader(path).records
        if r[0] == b"E"
        for item in TraceReader(path)._payload(r)
    ]
    stored = [it for it in items if it[0] == trace_format._CODE[EngineBlockStored]]
    assert len(stored) == 100 and all(it[4] != -1 for it in stored)  # all by reference


def test_every_step_is_on_disk_once_flushed(tmp_path, monkeypatch):
    monkeypatch.setattr(writer, "FLUSH_SECONDS", 0.0)  # a slow (model) step: flush each one
    steps = []

    def check(path):
        steps.append(TraceReader(path).state_at().last_snapshot.step)

    record(tmp_path, on_step=check)
    assert steps == list(range(len(steps)))


def test_a_torn_last_record_is_dropped_with_a_note(tmp_path, small_records):
    path, seen = record(tmp_path)
    data = path.read_bytes()
    reader = TraceReader(path)
    last_e = [r for r in reader.records if r[0] == b"E"][-1]
    cut = data[: last_e[3] + last_e[4] // 2]  # killed halfway through the last record
    path.write_bytes(cut)
    torn = TraceReader(path)
    assert torn.note and "torn" in torn.note
    assert torn.state_at().last_snapshot.step == last_e[1] - 1
    path.write_bytes(data[: last_e[3] - 5])  # cut inside the record's prefix
    assert TraceReader(path).state_at().last_snapshot.step == last_e[1] - 1


@pytest.mark.parametrize(
    "content, message",
    [
        (b"", "not a nanokv trace"),
        (b"PK\x03\x04 not a trace", "not a nanokv trace"),
        (b'{"prompt": "x"}\n', "not a nanokv trace"),
        (
            b'{"format": "nanokv-trace", "version": 99, "block_size": 4, "num_blocks": 8}\n',
            "version 99 is not supported",
        ),
        (
            b'{"format": "nanokv-trace", "version": 1, "block_size": 0, "num_blocks": 8}\n',
            "lacks a valid 'block_size'",
        ),
        (trace_format.MAGIC, "no header record"),
    ],
)
def test_bad_files(tmp_path, content, message):
    path = tmp_path / "t.trace"
    path.write_bytes(content)
    with pytest.raises(TraceError, match=message):
        TraceReader(path)


def test_damaged_payload_and_wrong_version(tmp_path, small_records):
    path, _ = record(tmp_path)
    data = bytearray(path.read_bytes())
    reader = TraceReader(path)
    first_e = next(r for r in reader.records if r[0] == b"E")
    data[first_e[3] + 8] ^= 0xFF  # a flipped byte: zstd's checksum catches it
    path.write_bytes(bytes(data))
    with pytest.raises(TraceError, match="damaged record"):
        list(TraceReader(path).events())
    other = tmp_path / "v3.trace"
    header = make_header(block_size=4, num_blocks=8, model=None)
    with TraceWriter(other, {**header, "version": 3}):
        pass
    with pytest.raises(TraceError, match="version 3 is not supported"):
        TraceReader(other)


def test_version_1_jsonl_traces_still_open(tmp_path, small_records):
    path, seen = record(tmp_path)
    v1 = tmp_path / "v1.trace"
    with open(v1, "wb") as f:
        export(TraceReader(path), "jsonl", f)
    reader = TraceReader(v1)
    assert reader.header["version"] == 1
    assert [as_json(e) for e in reader.events()] == [as_json(e) for e in seen]
    expected = live_states(seen)
    for step in (0, max(expected) // 2, max(expected)):
        assert books(reader.state_at(step))[:3] == expected[step][:3]
    lines = v1.read_text().splitlines()
    v1.write_text("\n".join([lines[0], '{"type": "Nonsense"}']) + "\n")
    with pytest.raises(TraceError, match="line 2: not a trace event"):
        TraceReader(v1).state_at()
    v1.write_text(lines[0] + "\n")
    with pytest.raises(TraceError, match="holds no steps"):
        TraceReader(v1).state_at()
    with pytest.raises(TraceError, match="no such file"):
        TraceReader(tmp_path / "missing.trace")


# -- vLLM's KV events, decoded with vLLM's own struct layout ------------------------------------


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list | None = None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def test_vllm_kv_event_export_decodes_with_vllms_structs(tmp_path, small_records):
    path, seen = record(tmp_path)
    out = io.BytesIO()
    n = export(TraceReader(path), "vllm-kv-events-array", out)  # vLLM's older encoding
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    batches = [
        decoder.decode(msgpack.packb(obj)) for obj in msgpack.Unpacker(io.BytesIO(out.getvalue()))
    ]
    assert len(batches) == n > 0
    raw = next(iter(msgpack.Unpacker(io.BytesIO(out.getvalue()))))
    # vLLM's msgspec array_like layout (what Dynamo decodes): [ts, events, data_parallel_rank],
    # each event [tag, block_hashes, parent_block_hash, token_ids, block_size, lora_id,
    # medium, lora_name].
    assert len(raw) == 3 and raw[2] == 0
    first = raw[1][0]
    assert first[0] == "BlockStored" and len(first) == 8 and first[5:] == [None, None, None]
    stored = [e for b in batches for e in b.events if isinstance(e, BlockStored)]
    removed = [e for b in batches for e in b.events if isinstance(e, BlockRemoved)]
    ours = [e for e in seen if type(e).__name__ == "BlockStored"]
    assert [s.block_hashes[0] for s in stored] == [e.block_hash for e in ours]
    assert [s.token_ids for s in stored] == [list(e.token_ids) for e in ours]
    assert all(s.block_size == BLOCK_SIZE for s in stored)
    # Today's encoding: the same batches, each event a map tagged by "type".
    maps = io.BytesIO()
    assert export(TraceReader(path), "vllm-kv-events", maps) == n
    first_batch = next(iter(msgpack.Unpacker(io.BytesIO(maps.getvalue()))))
    assert len(first_batch) == 3 and first_batch[2] == 0
    event = first_batch[1][0]
    assert event["type"] == "BlockStored" and event["block_hashes"] == first[1]
    assert event["token_ids"] == first[3] and event["group_idx"] == 0
    assert [r.block_hashes[0] for r in removed] == [
        e.block_hash for e in seen if type(e).__name__ == "BlockRemoved"
    ]
    assert [b.ts for b in batches] == sorted(b.ts for b in batches)


# -- synthesized prompts and model runs -------------------------------------------------------


def test_synthesized_prompts_are_stored_as_their_recipe(tmp_path):
    clock = VirtualClock()
    settings = EngineConfig(num_blocks=400, block_size=64)
    eng = LLMEngine(DryRunExecutor(settings, clock=clock), settings, clock=clock)
    requests = [
        Request(
            SynthesizedPrompt((1, 2, 3, 10 + i), 1800),
            SamplingParams(max_tokens=4, ignore_eos=True),
        )
        for i in range(6)
    ]
    path = tmp_path / "mc.trace"
    seen = []
    eng.events.subscribe(seen.append)
    with TraceWriter(path, make_header(block_size=64, num_blocks=400, model=None)) as writer:
        eng.events.subscribe(writer)
        for _ in Driver(eng, clock).run(Arrivals(all_at_once(requests))):
            pass
    assert path.stat().st_size < 6 * 1800 * 4 / 4  # far below the raw tokens
    reader = TraceReader(path)
    prompts = {
        e.seq_id: list(e.prompt_token_ids)
        for e in reader.events()
        if type(e).__name__ == "SequenceAdded"
    }
    assert [prompts[i] for i in sorted(prompts)] == [list(r.prompt_token_ids()) for r in requests]
    assert [as_json(e) for e in reader.events()] == [as_json(e) for e in seen]


def test_a_model_runs_trace_rebuilds_the_same_books(tmp_path):
    """Prompt and generated tokens, every block event, every snapshot: the state rebuilt
    from the trace equals the one rebuilt from the live events, at every step."""
    from support.models import make_tiny_model

    from nanokv_cli import LLM

    llm = LLM(
        str(make_tiny_model("llama", tmp_path / "m")),
        dtype="float32",
        device="cpu",
        block_size=4,
        num_blocks=40,
    )
    path = tmp_path / "model.trace"
    seen = []
    llm.engine.events.subscribe(seen.append)
    header = make_header(block_size=4, num_blocks=40, model=None)
    with TraceWriter(path, header) as writer:
        llm.engine.events.subscribe(writer)
        prefix = list(range(5, 30))
        llm.generate(
            [prefix + [40 + i] for i in range(4)], SamplingParams(max_tokens=9, ignore_eos=True)
        )
    reader = TraceReader(path)
    assert [as_json(e) for e in reader.events()] == [as_json(e) for e in seen]
    live = CacheState(40)
    generated_blocks = 0
    for event in seen:
        live.apply(event)
        if type(event) is StepSnapshot:
            assert books(reader.state_at(event.step)) == books(live)
        if type(event).__name__ == "BlockStored" and event.token_ids[-1] not in range(5, 44):
            generated_blocks += 1
    assert generated_blocks > 0  # blocks of generated tokens made it into the trace
    info = describe_state(reader.state_at(), 4)
    assert info["counts"]["cached"] > 0


@pytest.mark.parametrize(
    "event, message",
    [
        ({"type": "BlockAllocated", "seq_id": 0, "block_id": -1}, "block_id = -1 is out of range"),
        ({"type": "BlockAllocated", "seq_id": 0, "block_id": 8}, "block_id = 8 is out of range"),
        ({"type": "BlockAllocated", "seq_id": 0, "block_id": "x"}, "block_id = 'x'"),
        ({"type": "BlockFreed", "seq_id": 0, "block_id": 1.5, "ref_count": 0}, "block_id = 1.5"),
        (
            {"type": "BlockHit", "seq_id": None, "block_id": 1, "block_hash": 3, "kind": "shared"},
            "seq_id = None",
        ),
    ],
)
def test_event_fields_are_checked(tmp_path, event, message):
    """A hostile trace cannot alias blocks (-1 would be block 7 by Python indexing)."""
    header = {"format": "nanokv-trace", "version": 1, "block_size": 4, "num_blocks": 8}
    path = tmp_path / "t.trace"
    path.write_text(json.dumps(header) + "\n" + json.dumps(event) + "\n")
    with pytest.raises(TraceError, match=f"line 2: not a trace event .*{message}"):
        TraceReader(path).state_at()


def test_header_bounds_and_bad_text(tmp_path):
    path = tmp_path / "t.trace"
    header = {"format": "nanokv-trace", "version": 1, "block_size": 4, "num_blocks": 10**9}
    path.write_text(json.dumps(header) + "\n")
    with pytest.raises(TraceError, match="lacks a valid 'num_blocks'"):
        TraceReader(path)
    header.update(num_blocks=8, model=17)
    path.write_bytes(json.dumps(header).encode() + b"\n\xff\xfe\n")
    reader = TraceReader(path)
    assert reader.header["model"] is None  # not a path: no block text, no crash
    with pytest.raises(TraceError, match="line 2: not UTF-8"):
        reader.state_at()


def test_ctrl_c_inside_a_flush_leaves_a_readable_file(tmp_path, small_records, monkeypatch):
    eng = engine()
    path = tmp_path / "t.trace"
    writer = TraceWriter(
        path, make_header(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, model=None)
    )
    eng.events.subscribe(writer)
    calls = []
    real = writer._record

    def record_then_interrupt(kind, *args):
        calls.append(kind)
        if kind == b"E" and calls.count(b"E") == 3:
            real(kind, *args)
            raise KeyboardInterrupt  # after the payload, before the books are updated
        real(kind, *args)

    monkeypatch.setattr(writer, "_record", record_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        run_shared_prefix_workload(eng)
    writer.close()  # must not raise, nor write after the cut
    reader = TraceReader(path)
    assert reader.state_at().last_snapshot is not None
    assert len([r for r in reader.records if r[0] == b"E"]) == 3
