"""Scheduler and engine loop on the model-free executor."""

import pytest

from nanokv_cli.engine.block_manager import BlockManager
from nanokv_cli.engine.config import EngineConfig
from nanokv_cli.engine.core.dry_run import DryRunExecutor, VirtualClock
from nanokv_cli.engine.core.events import SequenceFinished, SequencePreempted, StepSnapshot
from nanokv_cli.engine.core.llm_engine import LLMEngine, RequestRejected
from nanokv_cli.engine.core.scheduler import Scheduler
from nanokv_cli.engine.sampling_params import SamplingParams
from nanokv_cli.engine.sequence import Sequence, SequenceStatus


def make(num_blocks=64, block_size=4, **kw):
    bm = BlockManager(num_blocks, block_size)
    return bm, Scheduler(bm, **kw)


def seq(n, block_size=4, max_tokens=4, start=0):
    return Sequence(
        list(range(start, start + n)),
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        block_size,
    )


def run_step(sched, token=1):
    seqs = sched.schedule()
    sched.postprocess(seqs, [token] * len(seqs))
    return seqs


def test_chunked_prefill_keeps_the_sequence_waiting_until_the_prompt_is_done():
    bm, sched = make(max_num_batched_tokens=8)
    s = seq(20)
    sched.add(s)
    steps = []
    while s.is_prefill:
        scheduled = sched.schedule()
        steps.append(s.num_scheduled_tokens)
        if s.num_cached_tokens + s.num_scheduled_tokens < s.num_tokens:
            assert s.status == SequenceStatus.WAITING and s in sched.waiting
        sched.postprocess(scheduled, [42] * len(scheduled))
        if s.is_prefill:
            assert s.num_completion_tokens == 0  # the chunk's sampled token was discarded
    assert steps == [8, 8, 4]
    assert s.status == SequenceStatus.RUNNING and s.completion_token_ids == [42]


def test_any_sequence_may_be_chunked_and_the_budget_is_filled():
    _, sched = make(max_num_batched_tokens=10)
    a, b = seq(6), seq(9, start=100)
    sched.add(a)
    sched.add(b)
    scheduled = sched.schedule()
    assert [(x.seq_id, x.num_scheduled_tokens) for x in scheduled] == [(a.seq_id, 6), (b.seq_id, 4)]


def test_prefill_and_decode_share_a_step_decodes_first():
    _, sched = make(max_num_batched_tokens=16)
    a = seq(5, max_tokens=10)
    sched.add(a)
    run_step(sched)
    b = seq(30, start=200)
    sched.add(b)
    scheduled = sched.schedule()
    assert scheduled[0] is a and a.num_scheduled_tokens == 1
    assert scheduled[1] is b and b.num_scheduled_tokens == 15


def test_max_num_seqs_limits_a_step():
    _, sched = make(max_num_seqs=2)
    for i in range(3):
        sched.add(seq(3, start=10 * i))
    assert len(sched.schedule()) == 2


def test_decode_preempts_the_most_recently_admitted_and_it_rehits_its_blocks():
    bm, sched = make(num_blocks=4, block_size=4)
    a, b = seq(4, max_tokens=8), seq(4, max_tokens=8, start=100)
    sched.add(a)
    sched.add(b)
    run_step(sched)  # both prefilled: one block each, blocks full and hashed
    assert bm.hash_to_block_id
    run_step(sched)  # each opens a second block
    for _ in range(3):
        run_step(sched)
    # 4 blocks, both need a third: the later one is preempted.
    scheduled = sched.schedule()
    assert scheduled == [a] and b.status == SequenceStatus.WAITING and b.is_prefill
    assert sched.waiting[0] is b and b.block_table == []
    assert bm.stats.preemptions == 1
    sched.postprocess(scheduled, [1])
    while a.status != SequenceStatus.FINISHED:
        run_step(sched)
    run_step(sched)  # b comes back and hits the blocks it computed before
    # a took one of the two blocks b freed (its tail, evicted first); b revives the other.
    assert b.num_prefix_hit_tokens == 0 and bm.stats.readmission_revived_hits == 4
    while not sched.is_finished():
        run_step(sched)
    assert b.num_completion_tokens == 8
    bm.check_invariants([])


def test_requests_that_can_never_run_are_rejected_up_front():
    _, sched = make(num_blocks=2, block_size=4, max_model_len=12)
    with pytest.raises(RequestRejected, match="max_model_len"):
        sched.add(seq(10, max_tokens=3))
    with pytest.raises(RequestRejected, match="KV blocks"):
        sched.add(seq(8, max_tokens=2))  # 9 tokens need KV: 3 blocks > 2
    with pytest.raises(RequestRejected, match="empty"):
        sched.add(seq(0))
    sched.add(seq(8, max_tokens=1))  # exactly fits: the last token needs no KV
    assert len(sched.waiting) == 1


def test_eos_stops_unless_ignored():
    _, sched = make(eos_token_ids=[7])
    a = Sequence([1, 2, 3], SamplingParams(max_tokens=5), 4)
    b = Sequence([1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True), 4)
    sched.add(a)
    sched.add(b)
    run_step(sched, token=7)
    assert a.status == SequenceStatus.FINISHED and a.finish_reason == "stop"
    assert b.status == SequenceStatus.RUNNING
    while not sched.is_finished():
        run_step(sched, token=7)
    assert b.finish_reason == "length" and b.num_completion_tokens == 5


def test_engine_outputs_events_and_timing_on_a_virtual_clock():
    clock = VirtualClock()
    settings = EngineConfig(num_blocks=32, block_size=4, max_num_batched_tokens=8)
    engine = LLMEngine(DryRunExecutor(settings, vocab_size=100, clock=clock), settings, clock=clock)
    events = []
    engine.events.subscribe(events.append)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    ids = [engine.add_request(list(p), params) for p in (range(10), range(10), range(100, 110))]
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.seq_id] = out
    assert set(finished) == set(ids)
    for out in finished.values():
        assert len(out.token_ids) == 3 and out.finish_reason == "length"
        assert out.arrival_time == 0.0 < out.first_token_time <= out.finish_time
    # Identical prompts give identical (deterministic) answers on the dry run.
    assert finished[ids[0]].token_ids == finished[ids[1]].token_ids
    snaps = [e for e in events if isinstance(e, StepSnapshot)]
    assert [s.step for s in snaps] == list(range(len(snaps)))
    assert snaps[0].kind == "prefill" and snaps[-1].kind == "decode"
    assert any(s.kind == "mixed" for s in snaps)
    assert snaps[-1].num_used_blocks == 0 and snaps[-1].num_free_blocks == 32
    assert sum(isinstance(e, SequenceFinished) for e in events) == 3
    # The second copy of the prompt found the first one's computed blocks.
    assert finished[ids[1]].num_cached_tokens == 8 and finished[ids[2]].num_cached_tokens == 0
    assert all(b.clock > a.clock for a, b in zip(snaps, snaps[1:]))


def test_engine_rejects_cleanly_and_stays_usable():
    settings = EngineConfig(num_blocks=2, block_size=4)
    engine = LLMEngine(DryRunExecutor(settings), settings)
    with pytest.raises(RequestRejected):
        engine.add_request(list(range(20)), SamplingParams(max_tokens=4))
    assert not engine.has_unfinished_requests()
    engine.add_request([1, 2], SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()


def test_oldest_sequence_always_progresses_under_pressure():
    """Two sequences that each need most of the cache: preemption must not livelock."""
    clock = VirtualClock()
    settings = EngineConfig(num_blocks=6, block_size=2, max_num_batched_tokens=3)
    engine = LLMEngine(DryRunExecutor(settings, clock=clock), settings, clock=clock)
    events = []
    engine.events.subscribe(events.append)
    for start in (0, 100):
        engine.add_request(
            list(range(start, start + 5)), SamplingParams(max_tokens=6, ignore_eos=True)
        )
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    assert not engine.has_unfinished_requests()
    assert any(isinstance(e, SequencePreempted) for e in events)
