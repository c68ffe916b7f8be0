"""Event traces: written per step, read back event for event, replayed to any step."""

from __future__ import annotations

import copy
import json

import pytest

from nanokv_cli.engine.dry_run import DryRunExecutor, VirtualClock
from nanokv_cli.engine.events import CacheState, StepSnapshot, event_to_dict
from nanokv_cli.engine.llm_engine import LLMEngine
from nanokv_cli.engine.sampling_params import SamplingParams
from nanokv_cli.trace import (
    TRACE_VERSION,
    TraceError,
    TraceReader,
    TraceWriter,
    describe_state,
    make_header,
)

BLOCK_SIZE, NUM_BLOCKS = 4, 24


def as_json(event) -> dict:
    return json.loads(json.dumps(event_to_dict(event)))


def engine() -> LLMEngine:
    clock = VirtualClock()
    return LLMEngine(
        DryRunExecutor(clock=clock), num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, clock=clock
    )


def run_shared_prefix_workload(eng: LLMEngine, on_step=None) -> None:
    """Requests that share a 12-token prefix, arriving one step apart so later ones hit."""
    prefix = list(range(100, 112))
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    for i in range(4):
        eng.add_request(prefix + [i] * (3 + i), params)
        eng.step()
        if on_step:
            on_step()
    while eng.has_unfinished_requests():
        eng.step()
        if on_step:
            on_step()


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


def test_header_then_one_event_per_line(tmp_path):
    path, seen = record(tmp_path)
    lines = path.read_text().splitlines()
    header = json.loads(lines[0])
    assert header["format"] == "nanokv-trace" and header["version"] == TRACE_VERSION
    assert header["block_size"] == BLOCK_SIZE and header["num_blocks"] == NUM_BLOCKS
    assert len(lines) == 1 + len(seen)
    assert [json.loads(line) for line in lines[1:]] == [as_json(e) for e in seen]


def test_every_step_is_on_disk_when_the_step_returns(tmp_path):
    checked = []

    def check(path):
        last = path.read_text().splitlines()[-1]
        checked.append(json.loads(last)["type"])

    record(tmp_path, on_step=check)
    assert checked and set(checked) == {"StepSnapshot"}


def test_reader_returns_the_recorded_events(tmp_path):
    path, seen = record(tmp_path)
    reader = TraceReader(path)
    assert reader.block_size == BLOCK_SIZE and reader.num_blocks == NUM_BLOCKS
    assert [as_json(e) for e in reader.events()] == [as_json(e) for e in seen]


def test_state_at_each_step_matches_the_live_state(tmp_path):
    path, seen = record(tmp_path)
    live = CacheState(NUM_BLOCKS)
    expected = {}
    for event in seen:
        live.apply(event)
        if type(event) is StepSnapshot:
            expected[event.step] = copy.deepcopy(
                (live.ref_count, live.block_hash, live.block_tables)
            )
    reader = TraceReader(path)
    assert any(rc > 1 for rc, _, _ in expected.values() for rc in rc), (
        "workload should share blocks"
    )
    for step, (rc, hashes, tables) in expected.items():
        state = reader.state_at(step)
        assert (state.ref_count, state.block_hash, state.block_tables) == (rc, hashes, tables)
        assert state.last_snapshot.step == step
    last = max(expected)
    assert reader.state_at().last_snapshot.step == last
    with pytest.raises(TraceError, match=f"no step {last + 1}; the trace has steps up to {last}"):
        reader.state_at(last + 1)


def test_a_cut_short_trace_reads_up_to_its_last_whole_step(tmp_path):
    path, _ = record(tmp_path)
    lines = path.read_text().splitlines(keepends=True)
    # Keep the header, the first step and part of the second, then half a line (killed mid-write).
    first_snapshot = next(i for i, line in enumerate(lines) if '"StepSnapshot"' in line)
    first_step = json.loads(lines[first_snapshot])["step"]
    second = next(
        i for i, line in enumerate(lines) if '"StepSnapshot"' in line and i > first_snapshot
    )
    cut = lines[: second - 1] + [lines[second - 1][:10]]
    path.write_text("".join(cut))
    reader = TraceReader(path)
    state = reader.state_at()
    assert state.last_snapshot.step == first_step
    whole = TraceReader(path).state_at(first_step)
    assert state.ref_count == whole.ref_count and state.block_tables == whole.block_tables


@pytest.mark.parametrize(
    "content, message",
    [
        ("", "not a nanokv trace"),
        ('{"prompt": "x"}\n', "not a nanokv trace"),
        (
            '{"format": "nanokv-trace", "version": 99, "block_size": 4, "num_blocks": 8}\n',
            "version 99 is not supported",
        ),
        (
            '{"format": "nanokv-trace", "version": 1, "block_size": 0, "num_blocks": 8}\n',
            "lacks a valid 'block_size'",
        ),
    ],
)
def test_bad_headers(tmp_path, content, message):
    path = tmp_path / "t.trace"
    path.write_text(content)
    with pytest.raises(TraceError, match=message):
        TraceReader(path)


def test_bad_event_line_and_missing_file(tmp_path):
    path = tmp_path / "t.trace"
    header = make_header(block_size=4, num_blocks=8, model=None)
    path.write_text(json.dumps(header) + '\n{"type": "Nonsense"}\n')
    with pytest.raises(TraceError, match="line 2: not a trace event"):
        TraceReader(path).state_at()
    path.write_text(json.dumps(header) + "\n")
    with pytest.raises(TraceError, match="holds no steps"):
        TraceReader(path).state_at()
    with pytest.raises(TraceError, match="no such file"):
        TraceReader(tmp_path / "missing.trace")


def test_events_that_do_not_fit_the_header(tmp_path):
    path, _ = record(tmp_path)
    lines = path.read_text().splitlines(keepends=True)
    header = json.loads(lines[0])
    header["num_blocks"] = 2
    path.write_text(json.dumps(header) + "\n" + "".join(lines[1:]))
    with pytest.raises(TraceError, match="do not fit the header"):
        TraceReader(path).state_at()


def test_describe_state_lists_tables_blocks_hashes_and_text(tmp_path):
    path, _ = record(tmp_path)
    reader = TraceReader(path)
    step = next(s for s in range(20) if any(rc > 1 for rc in reader.state_at(s).ref_count))
    state = reader.state_at(step)
    info = describe_state(state, BLOCK_SIZE, decode=lambda ids: "|".join(map(str, ids)))
    assert info["step"] == step
    tables = {s["seq_id"]: s["block_table"] for s in info["sequences"]}
    assert tables == state.block_tables
    shared = [b for b in info["blocks"] if b["state"] == "shared"]
    assert shared
    for block in shared:
        assert block["ref_count"] == len(block["seq_ids"]) > 1
        assert block["hash"] == state.block_hash[block["block_id"]] != -1
        # The shared prefix is 100..111: each shared block holds 4 of those tokens.
        assert block["token_ids"][0] in range(100, 112)
        assert block["text"] == "|".join(map(str, block["token_ids"]))
    counts = info["counts"]
    assert sum(counts.values()) == NUM_BLOCKS
    assert counts["free"] == NUM_BLOCKS - len(info["blocks"])
