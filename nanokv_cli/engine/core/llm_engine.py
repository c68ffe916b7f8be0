"""One engine loop for every executor: a model (ModelRunner) or the model-free DryRunExecutor."""

from __future__ import annotations

import functools
import itertools
import time
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from numbers import Integral
from typing import Protocol

import numpy as np

from ..block_manager import BlockManager
from ..config import EngineConfig
from ..sampling_params import SamplingParams
from ..sequence import TOKEN_ID_RANGE, Sequence, SequenceStatus
from ..tiers.books import TierBooks
from .events import EventBus, SequenceAdded, StepSnapshot
from .scheduler import RequestRejected, Scheduler
from .step_budget import StepBudget

__all__ = ["LLMEngine", "RequestOutput", "RequestRejected", "Executor"]


class Executor(Protocol):
    num_blocks: int  # KV blocks it holds: the engine's block manager hands out this many

    def run(self, seqs: list[Sequence]) -> list[int]:
        """Compute the scheduled tokens of each sequence; return one sampled token per sequence."""
        ...


@dataclass
class RequestOutput:
    seq_id: int
    new_token_ids: list[int]
    token_ids: list[int]  # every generated token so far
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None = None
    num_restored_tokens: int = 0  # ...of them, restored from the second tier (kv_tier)


class LLMEngine:
    def __init__(
        self,
        executor: Executor,
        config: EngineConfig,
        *,
        eos_token_ids: Iterable[int] = (),
        clock: Callable[[], float] | None = None,
    ) -> None:
        """``config.max_model_len`` None admits any length; ``LLM`` passes the model's limit.
        The cache size is the executor's (``num_blocks``), which a model runner may have sized
        from memory."""
        self.executor = executor
        self.config = config
        self.block_size = config.block_size
        self.events = EventBus()
        # The second tier's backend (kv_tier), the executor's: a model runner's moves K/V, a
        # dry run's only times restores. None: no tier (or it could not be opened).
        backend = getattr(executor, "tier", None)
        self.tier = TierBooks(backend, config.block_size) if backend is not None else None
        self.block_manager = BlockManager(
            executor.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            on_event=self.events,
            prefix_match=config.prefix_match,
            tier=self.tier,
        )
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            eos_token_ids=eos_token_ids,
            on_event=self.events,
            step_budget=(
                StepBudget(config.step_latency_target_ms / 1000)
                if config.step_latency_target_ms
                else None
            ),
        )
        if clock is None:
            start = time.perf_counter()
            clock = lambda: time.perf_counter() - start  # noqa: E731
        self._clock = clock
        # Executors that keep per-request state (a seeded sampler's generator) drop it here.
        self._forget = getattr(executor, "forget", None) or (lambda seq_id: None)
        self.num_steps = 0
        self._next_seq_id = itertools.count()  # request ids: 0, 1, ... in order of arrival
        self._outputs: dict[int, RequestOutput] = {}

    @property
    def clock(self) -> float:
        return self._clock()

    @property
    def num_blocks(self) -> int:
        return self.block_manager.num_blocks

    @functools.cached_property
    def vocab_size(self) -> int | None:
        """Token ids a request may hold: 0 to ``vocab_size - 1``, checked when it is added. An
        executor running a model knows its vocabulary (its ModelConfig); the dry run embeds
        nothing, so it takes any id that fits in int64 (None). Assign to set another limit."""
        runner = getattr(self.executor, "runner", self.executor)  # tensor parallel: rank 0
        return getattr(getattr(runner, "config", None), "vocab_size", None)

    def add_request(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None,
        prompt_recipe: list | None = None,
    ) -> int:
        """Queue a request; its id (0, 1, ... per engine). ``prompt_recipe`` optionally says how
        the prompt was made (e.g. a Mooncake request's hash ids), so traces can store that."""
        seq = Sequence(
            prompt_token_ids,
            sampling_params or SamplingParams(),
            self.block_size,
            seq_id=next(self._next_seq_id),
        )
        # Both raise RequestRejected before anything is recorded.
        check_token_ids(seq.token_ids, self.vocab_size)
        self.scheduler.check_admissible(seq)
        now = self.clock if arrival_time is None else arrival_time
        # Announced before it is queued: if a listener raises, there is nothing to undo (the
        # caller never learns the id, so a request queued anyway could never be aborted).
        if self.events:
            self.events(
                SequenceAdded(seq.seq_id, seq.prompt_token_ids, seq.max_tokens, now, prompt_recipe)
            )
        self._outputs[seq.seq_id] = RequestOutput(
            seq.seq_id, [], [], False, None, seq.num_prompt_tokens, 0, now, None
        )
        self.scheduler.add(seq)
        return seq.seq_id

    def has_unfinished_requests(self) -> bool:
        return not self.scheduler.is_finished()

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    def abort_request(self, seq_id: int) -> None:
        try:
            found = self.scheduler.abort(seq_id)
        except BaseException:
            self._recover([])  # finishes the abort; its output goes with it
            raise
        if found:
            self._outputs.pop(seq_id, None)
            self._forget(seq_id)

    def step(self) -> list[RequestOutput]:
        """Schedule, compute and record one step; the outputs of the requests that got a token.

        Exception-safe: whatever is raised inside (a KeyboardInterrupt in the forward pass, a
        failing listener or executor), the engine recovers before it propagates (_recover):
        every request is still queued, or finished with its blocks back, and stepping again
        goes on where it was. Tokens sampled before the exception are kept; that step's
        outputs are not returned, but each request's ``token_ids`` catches up."""
        t0 = time.perf_counter()
        self.block_manager.step = self.num_steps
        seqs: list[Sequence] = []
        budgeted = self.scheduler.step_budget is not None
        try:
            started = self.clock if budgeted else 0.0
            seqs = self.scheduler.schedule()
            token_ids = self.executor.run(seqs) if seqs else []
            listening = bool(self.events)
            if listening:  # postprocess resets num_scheduled_tokens and frees: read first
                scheduled = [(s.seq_id, s.num_scheduled_tokens, s.is_prefill) for s in seqs]
                in_use = len(self.block_manager.used_block_ids)
            advanced = self.scheduler.postprocess(seqs, token_ids)
            now = self.clock
            if budgeted:  # on the engine's clock: a dry run's virtual steps fit the same way
                self.scheduler.step_done(now - started)
            outputs = self._record(advanced, now)
            if listening:
                self._snapshot(scheduled, in_use, time.perf_counter() - t0, now)
        except BaseException:
            self._recover(seqs)
            raise
        self.num_steps += 1
        return outputs

    def _record(self, advanced: list[Sequence], now: float) -> list[RequestOutput]:
        outputs = []
        pending = self._outputs
        finished = []
        for seq in advanced:  # once per generated token: a plain loop, no helper calls
            out = pending[seq.seq_id]
            token = seq.last_token
            out.new_token_ids = [token]
            out.token_ids.append(token)
            if out.first_token_time is None:
                out.first_token_time = now
                out.num_cached_tokens = seq.num_prefix_hit_tokens
                out.num_restored_tokens = seq.num_prefix_restored_tokens
            if seq.status is SequenceStatus.FINISHED:
                out.finished = True
                out.finish_reason = seq.finish_reason
                out.finish_time = now
                del pending[seq.seq_id]
                finished.append(seq.seq_id)
            outputs.append(out)
        for seq_id in finished:  # after the loop: if the executor raises, the outputs are whole
            self._forget(seq_id)
        return outputs

    def _recover(self, seqs: list[Sequence]) -> None:
        """After an exception in a step (``seqs``: what it scheduled) or an abort: the
        scheduler makes its books whole (Scheduler.recover), then the outputs follow the
        sequences. Each catches up with the tokens its sequence got before the exception, and
        those of requests no longer queued (finished, or aborted) are closed and dropped."""
        sched = self.scheduler
        sched.recover()
        pending = self._outputs
        caught_up = [(pending[s.seq_id], s) for s in seqs if s.seq_id in pending]
        if caught_up:
            now = self.clock
            for out, seq in caught_up:
                _catch_up(out, seq, now)
        queued = {seq.seq_id for seq in itertools.chain(sched.running, sched.waiting)}
        for seq_id in [i for i in pending if i not in queued]:
            del pending[seq_id]
            self._forget(seq_id)

    def check_invariants(self) -> None:
        """Assert the books balance: the scheduler's and the block manager's
        (Scheduler.check_invariants), and one pending output for each queued request."""
        sched = self.scheduler
        sched.check_invariants()
        queued = {seq.seq_id for seq in itertools.chain(sched.running, sched.waiting)}
        assert set(self._outputs) == queued, (
            f"pending outputs {sorted(self._outputs)} != queued requests {sorted(queued)}"
        )

    def _snapshot(
        self, scheduled: list[tuple[int, int, bool]], in_use: int, wall: float, now: float
    ) -> None:
        bm, stats = self.block_manager, self.block_manager.stats
        num_prefill = sum(n for _, n, prefill in scheduled if prefill)
        num_decode = sum(1 for _, _, prefill in scheduled if not prefill)
        kind = (
            ("mixed" if num_decode else "prefill")
            if num_prefill
            else ("decode" if num_decode else "idle")
        )
        self.events(
            StepSnapshot(
                step=self.num_steps,
                kind=kind,
                num_free_blocks=len(bm.free_block_ids),
                num_used_blocks=len(bm.used_block_ids),
                num_cached_free_blocks=bm.num_cached_free_blocks,
                num_running=len(self.scheduler.running),
                num_waiting=len(self.scheduler.waiting),
                num_prefill_tokens=num_prefill,
                num_decode_tokens=num_decode,
                wall_time=wall,
                clock=now,
                queries=stats.queries,
                hits=stats.hits,
                shared_hits=stats.shared_hits,
                revived_hits=stats.revived_hits,
                evictions=stats.evictions,
                preemptions=stats.preemptions,
                scheduled=[(seq_id, n) for seq_id, n, _ in scheduled],
                readmission_queries=stats.readmission_queries,
                readmission_hits=stats.readmission_hits,
                miss_tokens=dict(stats.miss_tokens),
                copied_hits=stats.copied_hits,
                restored_hits=stats.restored_hits,
                tier_blocks=self.tier.num_blocks if self.tier is not None else 0,
                step_used_blocks=in_use,
            )
        )


def _catch_up(out: RequestOutput, seq: Sequence, now: float) -> None:
    """Bring ``out`` level with ``seq``: the tokens it got in a step that then raised."""
    new = list(seq.token_ids[seq.num_prompt_tokens + len(out.token_ids) :])
    if new:
        out.new_token_ids = new
        out.token_ids.extend(new)
        if out.first_token_time is None:
            out.first_token_time = now
            out.num_cached_tokens = seq.num_prefix_hit_tokens
            out.num_restored_tokens = seq.num_prefix_restored_tokens
    if seq.status is SequenceStatus.FINISHED:
        out.finished = True
        out.finish_reason = seq.finish_reason
        out.finish_time = now


def check_token_ids(token_ids: list[int] | array, vocab_size: int | None) -> None:
    """Raise RequestRejected naming the first id a prompt may not hold: not an integer, or
    outside the vocabulary (0 to ``vocab_size - 1``); without one, outside the ids a trace can
    record (``TOKEN_ID_RANGE``). One vectorized pass when the ids are fine."""
    lo, hi = TOKEN_ID_RANGE if vocab_size is None else (0, vocab_size)
    if isinstance(token_ids, array) and token_ids.typecode == "q":
        ids = np.frombuffer(token_ids, dtype=np.int64)
    else:
        try:
            ids = np.asarray(token_ids)
        except (OverflowError, TypeError, ValueError):
            ids = None  # too big for numpy's integers, or ragged: the loop below names it
    if ids is not None and _within(ids, lo, hi):
        return
    for i, t in enumerate(token_ids):
        if isinstance(t, bool) or not isinstance(t, Integral):
            raise RequestRejected(f"token id {t!r} at position {i} is not an integer")
        if not lo <= t < hi:
            where = (
                f"is outside the token ids a trace can record (0 to {hi - 1:,})"
                if vocab_size is None
                else f"is outside the vocabulary ({vocab_size} ids: 0 to {vocab_size - 1})"
            )
            raise RequestRejected(f"token id {t} at position {i} {where}")


def _within(ids: np.ndarray, lo: int, hi: int) -> bool:
    if ids.ndim != 1:
        return False  # nested lists
    if not ids.size:
        return True
    return ids.dtype == np.int64 and lo <= int(ids.min()) and int(ids.max()) < hi
