"""The request loop every command shares (``nanokv_cli.run.loop``), on the model-free engine."""

from __future__ import annotations

import threading

import pytest

from nanokv_cli.engine.config import EngineConfig
from nanokv_cli.engine.core.events import SequenceAdded, StepSnapshot
from nanokv_cli.engine.sampling_params import SamplingParams
from nanokv_cli.run.loop import Arrivals, Driver, Request, RequestQueue, dry_run_engine
from nanokv_cli.run.record import Run

SP = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def req(n: int = 40, first: int = 1, tag=None, max_tokens: int = 8) -> Request:
    return Request(list(range(first, first + n)), SamplingParams(max_tokens=max_tokens), tag=tag)


def test_arrivals_are_admitted_when_they_arrive():
    engine, clock = dry_run_engine(EngineConfig(block_size=16, num_blocks=64))
    added = []
    engine.events.subscribe(lambda e: added.append(e) if type(e) is SequenceAdded else None)
    late = Request(list(range(100, 140)), SP, arrival_time=2.0)
    driver = Driver(engine, clock)
    steps = list(driver.run(Arrivals([req(), late], start=0.5)))
    assert [e.arrival_time for e in added] == [0.5, 2.5]
    assert clock() > 2.5 and sum(len(s) for s in steps) == 16  # 8 tokens each
    assert driver.requests == {} and not engine.has_unfinished_requests()


def test_arrivals_out_of_order_are_an_error():
    engine, clock = dry_run_engine(EngineConfig(block_size=16, num_blocks=64))
    first = Request([1, 2, 3], SP, arrival_time=1.0)
    with pytest.raises(ValueError, match="order of arrival"):
        list(Driver(engine, clock).run(Arrivals([first, Request([4, 5], SP, arrival_time=0.5)])))


def test_rejections_go_to_the_callback_or_raise():
    engine, clock = dry_run_engine(EngineConfig(block_size=16, num_blocks=4))  # 64 tokens of cache
    too_big = req(n=100, tag="big")
    rejected = []
    driver = Driver(engine, clock, on_rejected=lambda r, e: rejected.append((r.tag, str(e))))
    list(driver.run(Arrivals([too_big, req(tag="ok")])))
    assert rejected[0][0] == "big" and "cache has only 4" in rejected[0][1]
    with pytest.raises(ValueError, match="cache has only 4"):
        list(Driver(engine, clock).run(Arrivals([req(n=100)])))


def test_a_queue_fed_from_another_thread_runs_until_closed():
    engine, clock = dry_run_engine(EngineConfig(block_size=16, num_blocks=256))
    queue = RequestQueue()
    done = {}

    def client() -> None:
        for i in range(20):
            queue.submit(req(first=1 + i, tag=i))
        queue.close()

    driver = Driver(engine, clock, max_waiting=float("inf"))
    tags = {}
    driver.on_added = lambda seq_id, r: tags.__setitem__(seq_id, r.tag)
    thread = threading.Thread(target=client)
    thread.start()
    for outputs in driver.run(queue):
        for out in outputs:
            if out.finished:
                done[tags[out.seq_id]] = len(out.token_ids)
    thread.join()
    assert done == dict.fromkeys(range(20), 8)
    with pytest.raises(RuntimeError):
        queue.submit(req())


def test_an_abort_frees_the_blocks_and_the_idle_engine_steps_once_more():
    engine, clock = dry_run_engine(EngineConfig(block_size=16, num_blocks=64))
    snaps = []
    engine.events.subscribe(lambda e: snaps.append(e) if type(e) is StepSnapshot else None)
    queue = RequestQueue()
    long = req(n=40, max_tokens=500)
    aborted = []
    driver = Driver(engine, clock, on_aborted=lambda seq_id, r: aborted.append((seq_id, r)))
    queue.submit(long)
    for i, outputs in enumerate(driver.run(queue)):
        if i == 2:
            assert snaps[-1].num_used_blocks > 0
            queue.abort(long)
            queue.abort(long)  # twice: the second finds nothing
            queue.close()
        if i == 3:
            assert outputs == []  # the step after the abort: idle, blocks freed
    assert aborted == [(0, long)] and driver.requests == {}
    assert snaps[-1].kind == "idle" and snaps[-1].num_used_blocks == 0
    assert snaps[-1].num_running == snaps[-1].num_waiting == 0


def test_abort_all_and_an_abort_before_admission():
    engine, clock = dry_run_engine(EngineConfig(block_size=16, num_blocks=64))
    queue = RequestQueue()
    a, b, c = req(tag="a", max_tokens=100), req(first=50, tag="b", max_tokens=100), req(tag="c")
    queue.submit(c)
    queue.abort(c)  # gone before the driver saw it: admitted and dropped in the same poll
    queue.submit(a)
    queue.submit(b)
    aborted = []
    driver = Driver(engine, clock, on_aborted=lambda seq_id, r: aborted.append(r.tag))
    for i, _ in enumerate(driver.run(queue)):
        if i == 1:
            queue.abort(None)
            queue.close()
    assert aborted == ["c", "a", "b"] and not engine.has_unfinished_requests()
    assert engine.block_manager.stats.queries > 0 and len(engine.block_manager.used_block_ids) == 0


def test_run_builds_the_report_and_records_a_trace(tmp_path):
    from nanokv_cli.trace.reader import TraceReader

    engine, clock = dry_run_engine(EngineConfig(block_size=16, num_blocks=64))
    trace = tmp_path / "run.trace"
    config = {"file": "x.jsonl", "dry_run": True, "model": None}
    with Run(engine, clock, config=config, latencies=False, record=trace) as run:
        list(Driver(engine, clock).run(Arrivals([req(), req()], start=run.start)))
        report = run.report(rejected=0)
    assert report["requests"] == 2 and report["output_tokens"] == 16
    assert report["file"] == "x.jsonl" and report["num_blocks"] == 64 and report["rejected"] == 0
    # The second prompt hit the first's two full blocks, then copied all but its last token.
    assert report["cache_hits"] == 39 and report["copied_hit_tokens"] == 7
    assert TraceReader(trace).state_at().last_snapshot is not None
    assert not engine.events  # every listener removed
