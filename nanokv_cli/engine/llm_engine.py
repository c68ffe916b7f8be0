"""One engine loop for every executor: a model (ModelRunner) or the model-free DryRunExecutor."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from .block_manager import BlockManager
from .events import EventBus, SequenceAdded, StepSnapshot
from .sampling_params import SamplingParams
from .scheduler import RequestRejected, Scheduler
from .sequence import Sequence, SequenceStatus

__all__ = ["LLMEngine", "RequestOutput", "RequestRejected", "Executor"]


class Executor(Protocol):
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


class LLMEngine:
    def __init__(
        self,
        executor: Executor,
        *,
        num_blocks: int,
        block_size: int = 256,
        enable_prefix_caching: bool = True,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        max_model_len: int | None = None,
        eos_token_ids: Iterable[int] = (),
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.executor = executor
        self.block_size = block_size
        self.events = EventBus()
        self.block_manager = BlockManager(
            num_blocks, block_size, enable_prefix_caching, on_event=self.events
        )
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            eos_token_ids=eos_token_ids,
            on_event=self.events,
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
        self.scheduler.add(seq)  # raises RequestRejected before anything is recorded
        now = self.clock if arrival_time is None else arrival_time
        self._outputs[seq.seq_id] = RequestOutput(
            seq.seq_id, [], [], False, None, seq.num_prompt_tokens, 0, now, None
        )
        if self.events:
            self.events(
                SequenceAdded(seq.seq_id, seq.prompt_token_ids, seq.max_tokens, now, prompt_recipe)
            )
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
        if self.scheduler.abort(seq_id):
            self._outputs.pop(seq_id, None)
            self._forget(seq_id)

    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        self.block_manager.step = self.num_steps
        seqs = self.scheduler.schedule()
        token_ids = self.executor.run(seqs) if seqs else []
        listening = bool(self.events)
        if listening:  # postprocess resets num_scheduled_tokens: read them first
            scheduled = [(s.seq_id, s.num_scheduled_tokens, s.is_prefill) for s in seqs]
        advanced = self.scheduler.postprocess(seqs, token_ids)
        now = self.clock
        outputs = self._record(advanced, now)
        if listening:
            self._snapshot(scheduled, time.perf_counter() - t0, now)
        self.num_steps += 1
        return outputs

    def _record(self, advanced: list[Sequence], now: float) -> list[RequestOutput]:
        outputs = []
        pending = self._outputs
        for seq in advanced:  # once per generated token: a plain loop, no helper calls
            out = pending[seq.seq_id]
            token = seq.last_token
            out.new_token_ids = [token]
            out.token_ids.append(token)
            if out.first_token_time is None:
                out.first_token_time = now
                out.num_cached_tokens = seq.num_prefix_hit_tokens
            if seq.status is SequenceStatus.FINISHED:
                out.finished = True
                out.finish_reason = seq.finish_reason
                out.finish_time = now
                del pending[seq.seq_id]
                self._forget(seq.seq_id)
            outputs.append(out)
        return outputs

    def _snapshot(self, scheduled: list[tuple[int, int, bool]], wall: float, now: float) -> None:
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
            )
        )
