"""Continuous batching with chunked prefill and recompute preemption.

Each step is built under one token budget (``max_num_batched_tokens``): first one token for
every running (decoding) sequence, then prompt chunks for waiting sequences in arrival order.
Prefill and decode share a step (Sarathi-style "mixed" steps) because

* decodes never stall behind a long prompt, so inter-token latency stays flat while new
  requests are admitted, and
* a decode token costs almost nothing extra when it rides along with a prefill's matmuls,
  whereas a decode-only step at small batch is bound by reading the weights.

Any sequence may be cut at the budget's edge, not only the first of a step as in nano-vllm, so
the budget is always filled. A partially prefilled sequence keeps its blocks and stays in
``waiting`` (status WAITING, ``is_prefill``) until its whole prompt is computed; the token
sampled after an unfinished chunk is discarded.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Iterable

from ..block_manager import BlockManager
from ..config import EngineConfig
from ..sequence import Sequence, SequenceStatus
from .events import EventListener, SequenceFinished, SequencePreempted
from .step_budget import StepBudget


class RequestRejected(ValueError):
    """A request that could never run with this engine's limits."""


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int = EngineConfig.max_num_seqs,
        max_num_batched_tokens: int = EngineConfig.max_num_batched_tokens,
        max_model_len: int | None = None,
        eos_token_ids: Iterable[int] = (),
        on_event: EventListener | None = None,
        step_budget: StepBudget | None = None,
    ) -> None:
        """``step_budget``: while sequences decode, a step takes only the prompt tokens that
        keep it under a latency target (step_budget.py); None: up to the token budget."""
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.on_event = on_event
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_prefilling = 0  # waiting sequences that already hold blocks (mid-prefill)
        self.step_budget = step_budget
        self._planned = (0, 0)  # the last step's decode rows and prompt tokens

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def check_admissible(self, seq: Sequence) -> None:
        """Raise RequestRejected if ``seq`` could never complete, whatever else is running."""
        n_prompt, n_max = seq.num_prompt_tokens, seq.max_tokens
        if n_prompt == 0:
            raise RequestRejected("the prompt is empty")
        if self.max_model_len is not None and n_prompt + n_max > self.max_model_len:
            raise RequestRejected(
                f"prompt ({n_prompt} tokens) + max_tokens ({n_max}) exceeds max_model_len "
                f"({self.max_model_len})"
            )
        bm = self.block_manager
        # The last generated token is never fed back, so its KV needs no slot.
        blocks_needed = -(-(n_prompt + n_max - 1) // bm.block_size)
        if blocks_needed > bm.num_blocks:
            raise RequestRejected(
                f"request needs {blocks_needed} KV blocks of {bm.block_size} tokens "
                f"(prompt {n_prompt} + max_tokens {n_max}) but the cache has only "
                f"{bm.num_blocks}; raise the cache size or lower max_tokens"
            )

    def add(self, seq: Sequence) -> None:
        self.check_admissible(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    # -- building a step -------------------------------------------------------------------------

    def schedule(self) -> list[Sequence]:
        """Pick this step's sequences and set each one's ``num_scheduled_tokens``."""
        decodes = self._schedule_decodes()
        budget = self.max_num_batched_tokens - len(decodes)
        if self.step_budget is not None:
            budget = self.step_budget.prompt_tokens(len(decodes), budget)
        prefills = self._schedule_prefills(budget, self.max_num_seqs - len(decodes))
        if self.step_budget is not None:
            self._planned = (len(decodes), sum(s.num_scheduled_tokens for s in prefills))
        return decodes + prefills

    def step_done(self, seconds: float) -> None:
        """How long the step just scheduled took, for the step budget's cost model."""
        if self.step_budget is not None:
            self.step_budget.observe(*self._planned, seconds)

    def _schedule_decodes(self) -> list[Sequence]:
        bm = self.block_manager
        bs = bm.block_size
        running = self.running
        scheduled: list[Sequence] = []
        append = scheduled.append
        seq = None  # the one in hand: popped, not yet scheduled
        try:
            for _ in range(min(self.max_num_seqs, self.max_num_batched_tokens, len(running))):
                if not running:
                    break  # preemptions emptied the queue
                seq = running.popleft()
                # Hot path: most decode tokens land in a block they already have, so test that
                # first (what may_append tests) and only then go through can_append/preemption.
                if seq.num_tokens > len(seq.block_table) * bs and not self._make_room(seq):
                    seq = None  # preempted itself: it is waiting now
                    continue
                seq.num_scheduled_tokens = 1
                append(seq)
                seq = None
        finally:
            # Whatever was raised, every popped sequence goes back in its order; the one in
            # hand (while making room for it) only if it is still running.
            if seq is not None and seq.status is SequenceStatus.RUNNING:
                running.appendleft(seq)
            running.extendleft(reversed(scheduled))
        return scheduled

    def _make_room(self, seq: Sequence) -> bool:
        """Get ``seq`` the block its next token opens, preempting the most recently admitted
        holders as needed; False if ``seq`` itself had to be preempted."""
        bm = self.block_manager
        while not bm.can_append(seq):
            victim = self._pick_victim()
            if victim is None:
                self.preempt(seq)
                return False
            self.preempt(victim)
        bm.may_append(seq)
        return True

    def _pick_victim(self) -> Sequence | None:
        """The most recently admitted sequence holding blocks: running first, then mid-prefill.

        Taking mid-prefill sequences too (before giving up on the current one) means the oldest
        running sequence can always claim the whole cache, so the engine cannot livelock. The
        victim stays queued: preempt() moves it."""
        if self.running:
            return self.running[-1]
        if self.num_prefilling:
            for seq in reversed(self.waiting):
                if seq.block_table:
                    return seq
        return None

    def _schedule_prefills(self, budget: int, max_seqs: int) -> list[Sequence]:
        bm = self.block_manager
        scheduled: list[Sequence] = []
        admitting = True  # FCFS: once one new request does not fit, admit no later one
        holders_seen = 0
        for seq in self.waiting:
            if budget <= 0 or len(scheduled) >= max_seqs:
                break
            if seq.block_table:
                holders_seen += 1
            else:
                if not admitting:
                    if holders_seen >= self.num_prefilling:
                        break
                    continue
                num_cached_blocks = bm.can_allocate(seq)
                if num_cached_blocks == -1:
                    admitting = False
                    continue
                if bm.is_in_flight(seq, num_cached_blocks):
                    # In-batch prefix sharing: another sequence is computing this prompt's next
                    # blocks. Wait until they are registered and hit them, instead of computing
                    # a second copy. Nothing stalls: a leader that is preempted or aborted
                    # drops its claim, and this sequence then computes the blocks itself.
                    continue
                bm.allocate(seq, num_cached_blocks)
                self.num_prefilling += 1
                holders_seen += 1
            seq.num_scheduled_tokens = min(seq.num_tokens - seq.num_cached_tokens, budget)
            budget -= seq.num_scheduled_tokens
            scheduled.append(seq)
        # A sequence whose prompt completes this step moves to running in postprocess, once
        # its prompt is computed: a step that fails before then leaves it mid-prefill.
        return scheduled

    def preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop the KV, keep the tokens, queue at the front.

        Queues first, blocks after: if releasing the blocks is cut short by an exception, the
        sequence already waits holding part of them, and recover() preempts it again."""
        if seq.status is SequenceStatus.WAITING:  # mid-prefill victim: it keeps its place
            if seq.block_table:
                self.num_prefilling -= 1
        else:
            running = self.running
            if running and running[-1] is seq:
                running.pop()  # a victim: the most recently admitted
            elif seq in running:
                running.remove(seq)
            # (otherwise the decode loop holds it)
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)
        seq.is_prefill = True
        self.block_manager.deallocate(seq)
        self.block_manager.stats.preemptions += 1
        if self.on_event:
            self.on_event(SequencePreempted(seq.seq_id, seq.num_tokens))

    # -- after the forward pass ------------------------------------------------------------------

    def postprocess(self, seqs: list[Sequence], token_ids: list[int]) -> list[Sequence]:
        """Record computed KV and sampled tokens; return the sequences that got a new token.

        One sequence at a time, each in an order recover() can finish from: registering the
        blocks it filled (which changes nothing else if it raises), plain bookkeeping, then
        releasing it if it is done."""
        bm = self.block_manager
        bs = bm.block_size
        eos = self.eos_token_ids
        max_len = self.max_model_len or sys.maxsize
        advanced = []
        append = advanced.append
        # Runs for every sequence of every step: keep it to attribute arithmetic.
        for seq, token_id in zip(seqs, token_ids):
            start = seq.num_cached_tokens
            end = start + seq.num_scheduled_tokens
            if end // bs != start // bs:
                bm.hash_blocks(seq)  # a block became full and computed
            seq.num_cached_tokens = end
            seq.num_scheduled_tokens = 0
            if end < seq.num_tokens:
                continue  # an unfinished prompt chunk: its sampled token means nothing
            if seq.is_prefill:  # the prompt is computed: from now on it decodes
                seq.is_prefill = False
                self.waiting.remove(seq)
                self.num_prefilling -= 1
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
            seq.append_token(token_id)
            append(seq)
            if token_id in eos and not seq.ignore_eos:
                seq.finish_reason = "stop"
            elif (
                seq.num_tokens - seq.num_prompt_tokens >= seq.max_tokens
                or seq.num_tokens >= max_len
            ):
                seq.finish_reason = "length"
            else:
                continue
            # Marked before anything that may raise: a release cut short leaves a finished
            # sequence queued, which recover() releases (rather than let it decode on).
            seq.status = SequenceStatus.FINISHED
            self._release(seq, self.running)
        return advanced

    def _release(self, seq: Sequence, queue: deque[Sequence]) -> None:
        """Give a finished sequence's blocks back and take it off ``queue``. The sequence stays
        queued until its blocks are back, so a release cut short can be found and finished."""
        if queue is self.waiting and seq.block_table:
            self.num_prefilling -= 1
        self.block_manager.deallocate(seq)
        queue.remove(seq)
        if self.on_event:
            self.on_event(
                SequenceFinished(
                    seq.seq_id,
                    seq.finish_reason,
                    seq.num_prompt_tokens,
                    seq.num_completion_tokens,
                    max(0, seq.num_prefix_hit_tokens),
                )
            )

    def abort(self, seq_id: int) -> bool:
        """Drop a request wherever it is (e.g. the client went away). True if it was found."""
        for queue in (self.running, self.waiting):
            for seq in queue:
                if seq.seq_id == seq_id:
                    seq.status = SequenceStatus.FINISHED
                    seq.finish_reason = "abort"
                    self._release(seq, queue)
                    return True
        return False

    # -- after an exception ----------------------------------------------------------------------

    def recover(self) -> None:
        """Make the books whole after an exception cut a step (or an abort) short, wherever it
        was raised, so that every request can go on or be aborted.

        Every change above is ordered so that what an exception leaves is one of three things,
        all visible from the queues: a finished sequence still queued (its release was cut
        short: finished now), a sequence whose blocks do not match its progress (an admission
        or a preemption cut short: preempted, so it keeps its tokens and recomputes), or a
        consistent sequence. Then nothing stays scheduled, ``num_prefilling`` is counted
        afresh and the claims on blocks being computed are rebuilt. Tokens sampled before the
        exception stay: the engine's outputs catch up with them."""
        for queue in (self.running, self.waiting):
            for seq in list(queue):
                if seq.status is SequenceStatus.FINISHED:
                    self._release(seq, queue)
                elif not self._is_whole(seq):
                    self.preempt(seq)
                seq.num_scheduled_tokens = 0
        prefilling = [seq for seq in self.waiting if seq.block_table]
        self.num_prefilling = len(prefilling)
        self.block_manager.reclaim(prefilling)

    def _is_whole(self, seq: Sequence) -> bool:
        """Whether ``seq``'s blocks and counters are those of a step boundary."""
        num_held = len(seq.block_table)
        if seq.status is SequenceStatus.RUNNING:  # decoding: every token's KV but the last
            return (
                seq.num_cached_tokens == seq.num_tokens - 1
                and seq.num_tokens - 1 <= num_held * self.block_manager.block_size
                and num_held <= seq.num_blocks
            )
        if not num_held:  # waiting to be admitted
            return seq.num_cached_tokens == 0
        return num_held == seq.num_blocks and seq.num_cached_tokens < seq.num_tokens

    def check_invariants(self) -> None:
        """Assert the queues balance (the block manager's books included): what recover()
        restores, and what holds at every step boundary."""
        seen: set[int] = set()
        for queue, status in (
            (self.running, SequenceStatus.RUNNING),
            (self.waiting, SequenceStatus.WAITING),
        ):
            for seq in queue:
                assert id(seq) not in seen, f"{seq} is queued twice"
                seen.add(id(seq))
                assert seq.status is status, f"{seq} is in the wrong queue"
                assert seq.is_prefill == (status is SequenceStatus.WAITING), seq
                assert seq.num_scheduled_tokens == 0, f"{seq} is still scheduled"
                assert self._is_whole(seq), f"{seq}: blocks do not match its progress"
        holders = [seq for seq in self.waiting if seq.block_table]
        assert self.num_prefilling == len(holders), (
            f"num_prefilling {self.num_prefilling} != {len(holders)} sequences mid-prefill"
        )
        self.block_manager.check_invariants(list(self.running) + holders)
