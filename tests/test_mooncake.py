"""Mooncake traces: parsing, token synthesis, and a dry run of a slice of the real trace."""

import json
from pathlib import Path

import pytest

from nanokv_cli.engine.config import EngineConfig
from nanokv_cli.engine.core.dry_run import DryRunExecutor, VirtualClock
from nanokv_cli.engine.core.llm_engine import LLMEngine
from nanokv_cli.engine.core.requests import Request
from nanokv_cli.engine.sampling_params import SamplingParams
from nanokv_cli.run.loop import Arrivals, Driver
from nanokv_cli.workload.mooncake import (
    MOONCAKE_BLOCK_SIZE,
    MalformedTraceError,
    parse_mooncake_line,
    read_mooncake,
    synthesize_tokens,
)

TRACE = Path(__file__).resolve().parents[1] / "examples/traces/mooncake_conversation_trace.jsonl"


def test_equal_hash_ids_give_equal_blocks_and_partial_blocks_are_prefixes():
    a = synthesize_tokens([0, 1, 2], 3 * 512)
    b = synthesize_tokens([0, 1, 7], 2 * 512 + 100)
    assert len(a) == 1536 and len(b) == 1124
    assert a[:1024] == b[:1024]
    assert a[1024:] != synthesize_tokens([0, 1, 7], 1536)[1024:]
    assert b[1024:] == synthesize_tokens([0, 1, 7], 1536)[1024:1124]
    assert all(0 <= t < 32000 for t in a)
    # Same id at a different position: the same 512 tokens (the hash chain tells them apart).
    assert synthesize_tokens([5], 512) == synthesize_tokens([9, 5], 1024)[512:]


@pytest.mark.parametrize(
    "line,match",
    [
        ("{oops", "not valid JSON"),
        ('{"timestamp": 0, "input_length": 10}', "expected the keys"),
        (
            '{"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [1]}',
            "do not cover",
        ),
        ('{"timestamp": 0, "input_length": 0, "output_length": 5, "hash_ids": []}', "input_length"),
        ('{"timestamp": -1, "input_length": 5, "output_length": 5, "hash_ids": [1]}', "timestamp"),
        ('{"timestamp": NaN, "input_length": 5, "output_length": 5, "hash_ids": [1]}', "finite"),
        (
            '{"timestamp": Infinity, "input_length": 5, "output_length": 5, "hash_ids": [1]}',
            "finite",
        ),
        (
            '{"timestamp": true, "input_length": 5, "output_length": 5, "hash_ids": [1]}',
            "timestamp",
        ),
    ],
)
def test_malformed_lines_name_the_line(line, match):
    with pytest.raises(MalformedTraceError, match=f"line 7: .*{match}"):
        parse_mooncake_line(line, 7)


def test_reader_reports_the_bad_line_number(tmp_path):
    good = json.dumps({"timestamp": 5, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]})
    path = tmp_path / "t.jsonl"
    path.write_text(good + "\n\n" + good + "\n" + '{"timestamp": 1}\n')
    reqs = read_mooncake(path)
    assert next(reqs).timestamp == 0.005
    assert next(reqs).line == 3
    with pytest.raises(MalformedTraceError, match="line 4"):
        next(reqs)


def test_dry_run_of_the_real_trace_slice_hits_the_shared_prefix():
    clock = VirtualClock()
    settings = EngineConfig(
        num_blocks=2000, block_size=MOONCAKE_BLOCK_SIZE, max_num_batched_tokens=16384
    )
    engine = LLMEngine(DryRunExecutor(settings, clock=clock), settings, clock=clock)
    trace = list(read_mooncake(TRACE, limit=200))
    reqs = [
        Request(
            r.prompt_token_ids,
            SamplingParams(max_tokens=r.output_length, ignore_eos=True),
            r.timestamp,
        )
        for r in trace
    ]
    done = {}
    for step, outs in enumerate(Driver(engine, clock).run(Arrivals(reqs))):
        for out in outs:
            if out.finished:
                done[out.seq_id] = out
        if step % 100 == 0:
            live = [
                s
                for s in list(engine.scheduler.running) + list(engine.scheduler.waiting)
                if s.block_table
            ]
            engine.block_manager.check_invariants(live)
    assert len(done) == 200
    assert sum(len(o.token_ids) for o in done.values()) == sum(r.output_length for r in trace)
    # Ceiling from the trace itself: a full block hits only if its hash id was seen before.
    seen, possible = set(), 0
    for r in trace:
        for h in r.hash_ids[: (r.input_length - 1) // 512]:
            if h not in seen:
                break
            possible += 512
        seen.update(r.hash_ids)
    stats = engine.block_manager.stats
    assert 0 < stats.hits <= possible
    if not stats.preemptions:  # every prompt was looked up exactly once
        assert stats.queries == sum(r.input_length for r in trace)
    engine.block_manager.check_invariants([])
