"""An exception at any point of an engine step (KeyboardInterrupt included) leaves the books
balanced: every request is still queued or finished with its blocks back, the event stream
still mirrors the cache, the interrupted requests can go on (to the same tokens) or be aborted,
and a clean re-run gives the same tokens and counters as an engine that never failed.

The randomized part injects a fault at every point of each workload: each allocation and free
(the free queue, the pool, the block manager), hash registration, each change of the copy
sources, scheduling decision, the forward pass, each event delivered to a listener, the clock
and the executor's ``forget``."""

import copy
from collections import Counter
from dataclasses import dataclass, fields
from itertools import chain

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanokv_cli.engine.config import EngineConfig
from nanokv_cli.engine.core.dry_run import DryRunExecutor, VirtualClock
from nanokv_cli.engine.core.events import BlockAllocated, CacheState
from nanokv_cli.engine.core.llm_engine import LLMEngine, RequestRejected
from nanokv_cli.engine.sampling_params import SamplingParams


class Injected(BaseException):
    """The injected fault: a BaseException, as KeyboardInterrupt is, so no ``except
    Exception`` in the engine can swallow it."""


# Methods called at each point: before the call, and (the effect done, the caller none the
# wiser) after it. The free queue's operations are single dict operations, faulted before.
BLOCK_MANAGER_POINTS = (
    "can_allocate",
    "is_in_flight",
    "allocate",
    "_evict",
    "_allocate_free_block",
    "can_append",
    "may_append",
    "deallocate",
    "hash_blocks",
)
SCHEDULER_POINTS = (
    "schedule",
    "_schedule_decodes",
    "_schedule_prefills",
    "_make_room",
    "_pick_victim",
    "preempt",
    "postprocess",
    "_release",
    "abort",
)
FREE_QUEUE_POINTS = ("popleft", "append", "remove")
# The pool's and the copy sources' changes: each done whole or not begun, faulted before.
POOL_POINTS = ("take_hit", "take_free", "release", "register", "uncache")
COPY_SOURCE_POINTS = ("offer", "withdraw")
EXPLAINER_POINTS = ("explain", "admitted", "progressed", "released", "stored")


class Faults:
    """Counts the calls at every fault point of one engine; raises Injected at call number
    ``target`` (None: only counts)."""

    def __init__(self, engine: LLMEngine, target: int | None) -> None:
        self.target = target
        self.count = 0
        self.reached: Counter[str] = Counter()  # calls per point
        bm, sched = engine.block_manager, engine.scheduler
        for name in BLOCK_MANAGER_POINTS:
            self._wrap(bm, name, after=True)
        for name in SCHEDULER_POINTS:
            self._wrap(sched, name, after=True)
        for name in FREE_QUEUE_POINTS:
            self._wrap(bm.free_block_ids, name, after=False)
        for name in POOL_POINTS:
            self._wrap(bm.pool, name, after=False)
        for name in COPY_SOURCE_POINTS:
            self._wrap(bm.sources, name, after=False)
        for name in EXPLAINER_POINTS:
            self._wrap(bm._explainer, name, after=False)
        self._wrap(engine.executor, "run", after=True)
        self._wrap(engine, "_forget", after=False)
        self._wrap(engine, "_clock", after=False)
        # After the mirror's: it sees every event.
        engine.events.subscribe(lambda event: self._point(type(event).__name__))

    def disarm(self) -> None:
        self.target = None

    def _point(self, name: str) -> None:
        self.count += 1
        self.reached[name] += 1
        if self.count == self.target:
            raise Injected(name, self.count)

    def _wrap(self, obj: object, name: str, *, after: bool) -> None:
        original = getattr(obj, name)

        def faulty(*args, **kwargs):
            self._point(name)
            result = original(*args, **kwargs)
            if after:
                self._point(name)
            return result

        setattr(obj, name, faulty)


@dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...]
    max_tokens: int
    arrival: int  # step
    abort_at: int | None  # step at which the client gives up on it


class Client:
    """Feeds requests to an engine step by step, as LLM.stream and the driver do. After an
    exception it can carry on where it was: a request whose add raised is added again, an
    abort that raised is sent again."""

    def __init__(self, engine: LLMEngine, requests: list[Request], check_steps: bool = False):
        self.engine, self.requests, self.check_steps = engine, requests, check_steps
        self.step = 0
        self.to_add = sorted(range(len(requests)), key=lambda i: requests[i].arrival)
        self.seq_ids: dict[int, int] = {}
        # The engine's own output objects: a step that raised returns none, but they catch up.
        self.outputs: dict = {}
        self.rejected: set[int] = set()
        self.aborted: set[int] = set()

    def run(self) -> None:
        engine, requests = self.engine, self.requests
        while self.to_add or engine.has_unfinished_requests():
            while self.to_add and requests[self.to_add[0]].arrival <= self.step:
                i = self.to_add[0]
                try:
                    params = SamplingParams(max_tokens=requests[i].max_tokens)
                    seq_id = engine.add_request(list(requests[i].prompt), params)
                except RequestRejected:
                    self.rejected.add(i)  # too big for this cache
                else:
                    self.seq_ids[i] = seq_id
                    self.outputs[i] = engine._outputs[seq_id]
                self.to_add.pop(0)
            for i, seq_id in self.seq_ids.items():
                at = requests[i].abort_at
                if at is not None and at <= self.step and i not in self.aborted:
                    engine.abort_request(seq_id)
                    self.aborted.add(i)
            self.step += 1
            engine.step()
            if self.check_steps:
                engine.check_invariants()
            assert self.step < 1000, "the engine does not converge"

    def results(self, *, completed_only: bool = False) -> dict[int, tuple[list[int], str]]:
        """Each request's tokens and finish reason (``completed_only``: of those never
        aborted, whose tokens do not depend on when an abort arrived)."""
        return {
            i: (list(out.token_ids), out.finish_reason)
            for i, out in self.outputs.items()
            if not completed_only or self.requests[i].abort_at is None
        }


def make_engine(config: EngineConfig) -> tuple[LLMEngine, CacheState]:
    clock = VirtualClock()
    engine = LLMEngine(
        DryRunExecutor(config, vocab_size=60, clock=clock), config, eos_token_ids=[0], clock=clock
    )
    mirror = CacheState(engine.num_blocks)
    engine.events.subscribe(mirror.apply)
    return engine, mirror


def check_books(engine: LLMEngine, mirror: CacheState) -> None:
    """The engine's invariants, and the cache rebuilt from events matches the books."""
    engine.check_invariants()
    bm = engine.block_manager
    assert mirror.ref_count == [b.ref_count for b in bm.blocks]
    assert mirror.block_hash == [b.hash for b in bm.blocks]
    queued = chain(engine.scheduler.running, engine.scheduler.waiting)
    assert mirror.block_tables == {s.seq_id: s.block_table for s in queued if s.block_table}


def counters(engine: LLMEngine) -> dict:
    stats = engine.block_manager.stats
    return {f.name: copy.copy(getattr(stats, f.name)) for f in fields(stats)}


def since(after: dict, before: dict) -> dict:
    return {
        k: {r: v[r] - before[k][r] for r in v} if isinstance(v, dict) else v - before[k]
        for k, v in after.items()
    }


@dataclass
class Reference:
    num_points: int
    reached: Counter
    results: dict
    completed: dict
    counters: dict


def reference_run(requests: list[Request], config: EngineConfig) -> Reference:
    engine, mirror = make_engine(config)
    faults = Faults(engine, None)
    client = Client(engine, requests, check_steps=True)
    client.run()
    check_books(engine, mirror)
    return Reference(
        faults.count,
        faults.reached,
        client.results(),
        client.results(completed_only=True),
        counters(engine),
    )


def fail_at(requests: list[Request], config: EngineConfig, target: int, ref: Reference) -> None:
    engine, mirror = make_engine(config)
    faults = Faults(engine, target)
    client = Client(engine, requests)
    with pytest.raises(Injected):
        client.run()
    faults.disarm()
    check_books(engine, mirror)
    if target % 2:  # carry on: the interrupted requests end as if nothing had happened
        client.run()
        assert client.results(completed_only=True) == ref.completed
    else:  # or give up: every request can be aborted, and none is left that the client lost
        for seq_id in client.seq_ids.values():
            engine.abort_request(seq_id)
        assert not engine.has_unfinished_requests()
    check_books(engine, mirror)
    assert not engine.block_manager.used_block_ids
    # A clean re-run from a cold cache: what an engine that never failed computes and counts.
    engine.block_manager.reset_prefix_cache()
    before = counters(engine)
    rerun = Client(engine, requests)
    rerun.run()
    assert rerun.results() == ref.results
    assert since(counters(engine), before) == ref.counters
    check_books(engine, mirror)


@st.composite
def workloads(draw):
    prefixes = draw(st.lists(st.lists(st.integers(1, 50), max_size=8), min_size=1, max_size=2))
    requests = []
    for _ in range(draw(st.integers(2, 6))):
        prefix = draw(st.sampled_from(prefixes))
        suffix = draw(st.lists(st.integers(0, 50), min_size=0 if prefix else 1, max_size=6))
        abort_at = draw(st.integers(0, 8)) if draw(st.integers(0, 3)) == 0 else None
        requests.append(
            Request(
                tuple(prefix + suffix), draw(st.integers(1, 6)), draw(st.integers(0, 4)), abort_at
            )
        )
    config = EngineConfig(
        num_blocks=draw(st.integers(3, 8)),
        block_size=draw(st.sampled_from([1, 2, 4])),
        enable_prefix_caching=draw(st.booleans()),
        max_num_seqs=3,
        max_num_batched_tokens=draw(st.integers(2, 10)),
    )
    return requests, config


@pytest.mark.slow
def test_an_exception_at_every_point_of_a_step_leaves_the_books_balanced():
    injected = []
    reached: Counter[str] = Counter()

    @settings(
        max_examples=100,
        derandomize=True,  # a stable count of points
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(workloads())
    def every_point(workload):
        requests, config = workload
        ref = reference_run(requests, config)
        for target in range(1, ref.num_points + 1):
            fail_at(requests, config, target, ref)
        injected.append(ref.num_points)
        reached.update(ref.reached)
        for name in ("preemptions", "evictions"):
            reached[name] += bool(ref.counters[name])

    every_point()
    assert sum(injected) >= 1000, injected
    points = BLOCK_MANAGER_POINTS + SCHEDULER_POINTS + FREE_QUEUE_POINTS + EXPLAINER_POINTS
    points += POOL_POINTS + COPY_SOURCE_POINTS
    events = ("CacheLookup", "BlockAllocated", "BlockHit", "BlockStored", "BlockRemoved")
    events += ("BlockFreed", "SequenceAdded", "SequencePreempted", "SequenceFinished")
    others = ("run", "_forget", "_clock", "StepSnapshot", "preemptions", "evictions")
    missed = [name for name in points + events + others if not reached[name]]
    assert not missed, f"never reached: {missed}"


def test_an_exception_at_every_point_of_a_batch_that_preempts_and_evicts():
    # A fixed workload that chunks, preempts, evicts and aborts: about 1,500 points.
    requests = [
        Request(tuple(range(1, 9)) + (i,), 6, i % 3, 5 if i == 4 else None) for i in range(8)
    ]
    config = EngineConfig(num_blocks=8, block_size=2, max_num_seqs=4, max_num_batched_tokens=6)
    ref = reference_run(requests, config)
    assert ref.counters["preemptions"] and ref.counters["evictions"]
    for target in range(1, ref.num_points + 1):
        fail_at(requests, config, target, ref)


def test_ctrl_c_inside_a_step_then_the_default_model_generates_the_same_tokens():
    from nanokv_cli import LLM

    llm = LLM(dtype="float32", num_blocks=16, block_size=16)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompts = ["The capital of France is", "One, two, three,"]
    expected = [o["token_ids"] for o in llm.generate(prompts, params)]
    embed = llm.model_runner.model.model.embed_tokens

    def interrupt_at(n: int):
        calls = []

        def interrupt(*_):
            calls.append(None)
            if len(calls) == n:
                raise KeyboardInterrupt

        return interrupt

    # In the forward pass: of the first step (the prefills), then of a later one (decodes).
    for n in (1, 3):
        handle = embed.register_forward_hook(interrupt_at(n))
        try:
            with pytest.raises(KeyboardInterrupt):
                llm.generate(prompts, params)
        finally:
            handle.remove()
        engine.check_invariants()
        assert not engine.has_unfinished_requests() and not engine.block_manager.used_block_ids
        assert [o["token_ids"] for o in llm.generate(prompts, params)] == expected
    # While the scheduler hands out blocks (a listener raising from inside an allocation).
    hook = interrupt_at(1)
    unsubscribe = engine.events.subscribe(lambda e: hook() if type(e) is BlockAllocated else None)
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate([p + " and" for p in prompts], params)
    finally:
        unsubscribe()
    engine.check_invariants()
    assert not engine.block_manager.used_block_ids
    assert [o["token_ids"] for o in llm.generate(prompts, params)] == expected


def test_an_exception_while_a_duplicate_block_is_reused_keeps_its_hash_announced():
    # The same prompt computed twice leaves two copies of a block's content (the newer one
    # serves the hash). Reusing the newer copy moves the hash to the older one: done in one
    # change, or an interrupt in between left the event mirror holding a hash the books had
    # dropped (points 175-176 before the block pool took it over).
    requests = [
        Request((18, 18, 1, 1, 12), 6, 0, None),
        Request((18, 18, 1, 1), 1, 1, None),
        Request((18, 18, 1, 1), 5, 4, None),
        Request((18, 18, 1, 1, 6, 24, 8), 1, 4, None),
    ]
    config = EngineConfig(num_blocks=4, block_size=2, max_num_seqs=3, max_num_batched_tokens=2)
    ref = reference_run(requests, config)
    assert ref.counters["evictions"]
    for target in range(1, ref.num_points + 1):
        fail_at(requests, config, target, ref)
