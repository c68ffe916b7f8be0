"""The step channel: rank 0 tells the workers what each step holds (``StepSender``); a
worker rebuilds the step and runs it (``StepReceiver``, ``serve``).

The step message is a flat int64 tensor. Workers keep a mirror of every live sequence, so a
step carries only what changed: the tokens a worker has not seen yet (the whole prompt once,
then one token per decode step) and the block-table entries past the part it already holds,
plus each sequence's ``num_cached_tokens``/``num_scheduled_tokens`` and ``kv_copy``. Sampling
fields stay on rank 0, the only rank that samples. Small messages (most decode steps) fit in
one fixed-size broadcast; larger ones take a second.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from ..runner.model_runner import ModelRunner
from ..sequence import Sequence
from .tp_common import _RECORD, _STEP, _STOP, HEADER_INTS


def _broadcast_message(values: array, group: Any) -> list[Any]:
    """Start broadcasting ``values`` from rank 0; returns the pending works and their buffers."""
    if len(values) < HEADER_INTS:
        values.frombytes(bytes(values.itemsize * (HEADER_INTS - len(values))))
    # An int64 array converts to a tensor without a per-element loop (torch.tensor(list) has one).
    message = torch.frombuffer(values, dtype=torch.int64)
    head = message[:HEADER_INTS]
    pending = [(dist.broadcast(head, 0, group=group, async_op=True), values)]
    if len(message) > HEADER_INTS:
        rest = message[HEADER_INTS:]
        pending.append((dist.broadcast(rest, 0, group=group, async_op=True), values))
    return pending


def _receive_message(group: Any) -> list[int]:
    head = torch.empty(HEADER_INTS, dtype=torch.int64)
    dist.broadcast(head, 0, group=group)
    length = 2 + int(head[1])
    if length <= HEADER_INTS:
        return head[:length].tolist()
    rest = torch.empty(length - HEADER_INTS, dtype=torch.int64)
    dist.broadcast(rest, 0, group=group)
    return head.tolist() + rest.tolist()


class StepSender:
    """Rank 0's side: describes each step by what the workers' mirrors lack."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self._sent_tokens: dict[int, int] = {}  # seq_id -> tokens the workers hold
        self._sent_tables: dict[int, list[int]] = {}  # seq_id -> block table the workers hold
        self._forgotten: list[int] = []
        self._pending: list[Any] = []

    def forget(self, seq_id: int) -> None:
        if self._sent_tokens.pop(seq_id, None) is not None:
            self._forgotten.append(seq_id)
        self._sent_tables.pop(seq_id, None)

    def send_step(self, seqs: Iterable[Sequence]) -> None:
        self.wait()
        values = array("q", [_STEP, 0, len(self._forgotten), *self._forgotten])
        self._forgotten = []
        seqs = list(seqs)
        values.append(len(seqs))
        sent_tokens, sent_tables = self._sent_tokens, self._sent_tables
        for s in seqs:
            seq_id, cached, n = s.seq_id, s.num_cached_tokens, s.num_scheduled_tokens
            end = cached + n
            have = sent_tokens.get(seq_id, 0)
            tokens = s.token_ids[have:end] if end > have else ()
            if end > have:
                sent_tokens[seq_id] = end
            table = s.block_table
            held = sent_tables.get(seq_id)
            if held is not None and table[: len(held)] == held:
                keep = len(held)
                held += table[keep:]
            else:  # new, or preempted and given other blocks: resend it whole
                keep = 0
                sent_tables[seq_id] = list(table)
            copy = s.kv_copy or (-1, -1, 0)  # a token-granular hit's K/V, copied on every rank
            values.extend(
                (seq_id, cached, n, int(s.is_prefill), len(tokens), keep, len(table) - keep, *copy)
            )
            values.extend(tokens)
            values.extend(table[keep:])
        values[1] = len(values) - 2
        self._pending = _broadcast_message(values, self.group)

    def send_stop(self) -> None:
        self.wait()
        self._pending = _broadcast_message(array("q", [_STOP, 0]), self.group)
        self.wait()

    def wait(self) -> None:
        """Block until the last message has left (raises if a worker went away)."""
        pending, self._pending = self._pending, []
        for work, _ in pending:
            work.wait()


class StepReceiver:
    """A worker's side: rebuilds rank 0's sequences from the messages into local mirrors."""

    def __init__(self, group: Any, block_size: int) -> None:
        self.group = group
        self.block_size = block_size
        self.mirrors: dict[int, Sequence] = {}

    def receive(self) -> list[Sequence] | None:
        """The next step's sequences, or None when rank 0 says stop."""
        values = _receive_message(self.group)
        if values[0] == _STOP:
            return None
        num_forgotten = values[2]
        for seq_id in values[3 : 3 + num_forgotten]:
            self.mirrors.pop(seq_id, None)
        i = 3 + num_forgotten
        num_seqs = values[i]
        i += 1
        seqs = []
        for _ in range(num_seqs):
            seq_id, cached, n, prefill, num_tokens, keep, num_blocks, *copy = values[
                i : i + _RECORD
            ]
            i += _RECORD
            seq = self.mirrors.get(seq_id)
            if seq is None:
                seq = Sequence([], block_size=self.block_size)
                seq.seq_id = seq_id
                self.mirrors[seq_id] = seq
            if num_tokens:
                seq.token_ids += values[i : i + num_tokens]
                seq.num_tokens = len(seq.token_ids)
                seq.last_token = seq.token_ids[-1]
                i += num_tokens
            del seq.block_table[keep:]
            seq.block_table += values[i : i + num_blocks]
            i += num_blocks
            seq.num_cached_tokens, seq.num_scheduled_tokens = cached, n
            seq.is_prefill = bool(prefill)
            seq.kv_copy = tuple(copy) if copy[2] else None
            seqs.append(seq)
        return seqs


def serve(runner: ModelRunner, receiver: StepReceiver) -> None:
    """A worker's loop: run every step rank 0 announces, until it says stop."""
    while (seqs := receiver.receive()) is not None:
        runner.run(seqs)


# -- worker processes (spawn mode) --------------------------------------------------------------
