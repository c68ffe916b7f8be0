"""Engines and their parts for tests: dry-run engines on a virtual clock, block-manager steps
taken by hand, workloads replayed with the books checked after every step, the books of a
``CacheState``, and a model runner driven without the scheduler."""

from __future__ import annotations

from typing import TYPE_CHECKING

from nanokv_cli.engine.config import EngineConfig
from nanokv_cli.engine.core.dry_run import DryRunExecutor, VirtualClock
from nanokv_cli.engine.core.events import CacheLookup
from nanokv_cli.engine.core.llm_engine import LLMEngine, RequestRejected
from nanokv_cli.engine.sampling_params import SamplingParams
from nanokv_cli.engine.sequence import Sequence

if TYPE_CHECKING:  # the dry-run helpers stay off torch
    from nanokv_cli.engine.runner.model_runner import ModelRunner

# -- dry-run engines ------------------------------------------------------------------------------


def dry_engine(num_blocks=4096, block_size=4, vocab_size: int | None = 60, **config) -> LLMEngine:
    """A model-free engine on a virtual clock; ``vocab_size=None``: the executor's default."""
    clock = VirtualClock()
    settings = EngineConfig(num_blocks=num_blocks, block_size=block_size, **config)
    vocab = {} if vocab_size is None else {"vocab_size": vocab_size}
    return LLMEngine(DryRunExecutor(settings, clock=clock, **vocab), settings, clock=clock)


def run_workload(
    requests,
    *,
    block_size,
    num_blocks,
    max_batched,
    prefix_caching=True,
    check=True,
    listener=None,
    after_step=None,
    prefix_match="token",
):
    """Replay ``requests`` (prompt, max_tokens, arrival step), checking the books after every
    step; ``listener`` gets every event, ``after_step(engine)`` runs after every step."""
    clock = VirtualClock()
    settings = EngineConfig(
        num_blocks=num_blocks,
        block_size=block_size,
        enable_prefix_caching=prefix_caching,
        max_num_seqs=4,
        max_num_batched_tokens=max_batched,
        prefix_match=prefix_match,
    )
    engine = LLMEngine(
        DryRunExecutor(settings, vocab_size=60, clock=clock),
        settings,
        eos_token_ids=[0],
        clock=clock,
    )
    bm, sched = engine.block_manager, engine.scheduler
    if listener is not None:
        engine.events.subscribe(listener)
    pending = sorted(requests, key=lambda r: r[2])
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][2] <= step:
            prompt, max_tokens, _ = pending.pop(0)
            try:
                engine.add_request(prompt, SamplingParams(max_tokens=max_tokens))
            except RequestRejected:
                pass  # too big for this cache: must be refused, not hang the engine
        engine.step()
        step += 1
        if after_step is not None:
            after_step(engine)
        if check:
            live = [s for s in list(sched.running) + list(sched.waiting) if s.block_table]
            bm.check_invariants(live)
        assert step < 10_000, "engine did not converge"
    bm.check_invariants([])
    assert not bm.used_block_ids


# -- the block manager, step by step --------------------------------------------------------------


def seq_of(tokens, block_size=4, max_tokens=4):
    return Sequence(
        list(tokens), SamplingParams(max_tokens=max_tokens, ignore_eos=True), block_size
    )


def compute(bm, seq):
    """What a step computing the rest of ``seq`` does to the books."""
    seq.num_scheduled_tokens = seq.num_tokens - seq.num_cached_tokens
    bm.hash_blocks(seq)
    seq.num_cached_tokens = seq.num_tokens
    seq.num_scheduled_tokens = 0


def lookup_of(bm, seq):
    """Admit ``seq`` and return the CacheLookup it emitted."""
    seen = []
    bm.on_event = lambda e: seen.append(e) if type(e) is CacheLookup else None
    bm.allocate(seq, bm.can_allocate(seq))
    bm.on_event = None
    return seen[0]


def books(state):
    """A ``CacheState``'s books, as plain values two states can be compared by."""
    return (
        state.ref_count,
        state.block_hash,
        state.block_tables,
        {b: list(t) for b, t in state.block_tokens.items()},
        {s: list(p) for s, p in state.prompts.items()},
    )


# -- a model runner driven without the engine -----------------------------------------------------


class Driver:
    """A stand-in for the scheduler and block manager: FIFO free list, no prefix hashing."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.bs = runner.block_size
        self.free = list(range(runner.num_blocks))
        self.step_kinds: list[set[str]] = []

    def new(self, prompt: list[int]) -> Sequence:
        return Sequence(prompt, SamplingParams(temperature=0.0), block_size=self.bs)

    def step(self, plan: list[tuple[Sequence, int]]) -> list[int]:
        """Compute ``n`` more tokens of each seq; append the sampled token where a seq is done."""
        for seq, n in plan:
            seq.num_scheduled_tokens = n
            while len(seq.block_table) * self.bs < seq.num_cached_tokens + n:
                seq.block_table.append(self.free.pop(0))
        self.step_kinds.append({"decode" if n == 1 else "prefill" for _, n in plan})
        tokens = self.run([seq for seq, _ in plan])
        for (seq, n), token in zip(plan, tokens):
            seq.num_cached_tokens += n
            if seq.num_cached_tokens == seq.num_tokens:  # an unfinished chunk's token is dropped
                seq.append_token(token)
        return tokens

    def run(self, seqs: list[Sequence]) -> list[int]:
        return self.runner.run(seqs)

    def release(self, seq: Sequence) -> None:
        self.free = seq.block_table + self.free  # reused first: later writes overwrite them
        seq.block_table = []
        seq.num_cached_tokens = 0

    def generate(
        self,
        prompts: list[list[int]],
        max_new: int,
        chunk: int | None = None,
        arrivals: list[int] | None = None,
    ) -> list[list[int]]:
        """Continuous batching: seq i joins at step arrivals[i]; prompts go in chunks of `chunk`."""
        seqs = [self.new(p) for p in prompts]
        arrivals = arrivals or [0] * len(seqs)
        step = 0
        while any(s.num_completion_tokens < max_new for s in seqs):
            plan = []
            for seq, arrival in zip(seqs, arrivals):
                if arrival <= step and seq.num_completion_tokens < max_new:
                    todo = seq.num_tokens - seq.num_cached_tokens
                    plan.append((seq, min(todo, chunk or todo)))
            if plan:
                self.step(plan)
            step += 1
        return [s.completion_token_ids for s in seqs]
