"""Events records: a step's events decoded from the format's lists (a stored block's tokens
from the prompt it names), each checked, and the record's steps checked against its prefix."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..engine.core.events import BlockStored, Event, SequenceAdded, StepSnapshot
from .checks import _check_event
from .format import (
    _ADDED,
    _CODES,
    _PREFIX,
    _SNAPSHOT,
    _STORED,
    TraceError,
    _reason,
    _short,
    _tokens,
)
from .prompts import PromptStore
from .records import Record, RecordFile


def _decode(item: list, prompt_of: Callable[[int], Any] | None, bs: int, slice_of) -> Event:
    """An event from its encoded list; without ``prompt_of``, token ids are left empty."""
    if type(item) is not list or not item:
        raise ValueError(f"event {_short(item)} is not a list")
    code = item[0]
    if type(code) is not int or not 0 <= code < len(_CODES):
        raise ValueError(f"unknown event code {_short(code)}")
    cls = _CODES[code]
    if code == _STORED:
        _, b, h, parent, seq_id, ref = item
        if seq_id == -1 and (type(ref) is not bytes or len(ref) != 4 * bs):
            raise ValueError(f"BlockStored tokens {_short(ref)} are not one block's")
        if prompt_of is None:
            tokens = []
        elif seq_id == -1:
            tokens = _tokens(ref)
        else:
            if type(ref) is not int:
                raise ValueError(f"BlockStored block index {_short(ref)} is not valid")
            tokens = slice_of(seq_id, ref * bs, (ref + 1) * bs)
        return BlockStored(b, h, parent, tokens)
    if code == _ADDED:
        _, seq_id, max_tokens, arrival = item
        prompt, recipe = prompt_of(seq_id) if prompt_of is not None else ([], None)
        return SequenceAdded(seq_id, prompt, max_tokens, arrival, recipe)
    if code == _SNAPSHOT:
        snap = StepSnapshot(*item[1:])
        snap.scheduled = [tuple(x) for x in snap.scheduled]
        return snap
    return cls(*item[1:])


def _span(steps: list[int]) -> str:
    if len(steps) > 4:
        return f"{', '.join(f'{s:,}' for s in steps[:3])}, ... {steps[-1]:,}"
    return ", ".join(f"{s:,}" for s in steps)


class EventRecords:
    """Decodes the events records of a version-2 trace."""

    def __init__(self, file: RecordFile, prompts: PromptStore) -> None:
        self.file = file
        self.prompts = prompts
        self.path = file.path

    def decoded(self, record: Record, tokens: bool = True) -> list[Event]:
        bs = self.file.block_size
        items = self.file.payload(record)
        prompt_of = self.prompts.prompt if tokens else None
        n = self.file.num_blocks
        try:
            if type(items) is not list:
                raise ValueError(f"{_short(items)} is not a list of events")
            events = [_decode(it, prompt_of, bs, self.prompts.prompt_slice) for it in items]
            for event in events:
                _check_event(event, n)
        except TraceError:
            raise  # already says what is wrong
        except (TypeError, ValueError, IndexError) as e:
            raise TraceError(
                f"{self.path}: a record does not hold trace events ({_reason(e)})"
            ) from None
        steps = [e.step for e in events if type(e) is StepSnapshot]
        self._check_steps(record, steps, bool(events) and type(events[-1]) is StepSnapshot)
        return events

    def _check_steps(self, record: Record, steps: list[int], ends: bool) -> None:
        """An events record holds whole steps, those its prefix names: a step's events end
        with its snapshot, so the record ends with one, and the snapshots count its steps."""
        _, first, last, at, _ = record
        where = f"{self.path}: the events record at byte {at - _PREFIX.size}"
        if not ends:
            raise TraceError(f"{where} does not end at the end of a step (a step's snapshot)")
        if (
            steps[0] != first
            or steps[-1] != last
            or len(steps) != last - first + 1
            or any(b - a != 1 for a, b in zip(steps, steps[1:]))
        ):
            raise TraceError(
                f"{where} holds steps {_span(steps)}; its prefix says {first:,} to {last:,}"
            )

    def last_snapshot(self, record: Record) -> StepSnapshot | None:
        """The last step snapshot of an events record, which carries the run's counters: only
        that event is decoded (the summary reads no other event, and checks none)."""
        items = self.file.payload(record)
        if type(items) is not list:
            return None
        last = next(
            (it for it in reversed(items) if type(it) is list and it[:1] == [_SNAPSHOT]), None
        )
        if last is None:
            return None
        try:
            return _decode(last, None, self.file.block_size, self.prompts.prompt_slice)
        except (TypeError, ValueError, IndexError) as e:
            at = record[3] - _PREFIX.size
            raise TraceError(f"{self.path}: damaged step snapshot at byte {at} ({e})") from None

    def count_codes(self, rec: Record, codes: list[int]) -> None:
        """Add an events record's events per type to ``codes``, without decoding them: only
        their type codes and the snapshots' steps are checked."""
        items = self.file.payload(rec)
        n = len(_CODES)
        steps = []
        try:
            if type(items) is not list:
                raise ValueError(f"{_short(items)} is not a list of events")
            for item in items:
                if type(item) is not list or not item:
                    raise ValueError(f"event {_short(item)} is not a list")
                code = item[0]
                if type(code) is not int or not 0 <= code < n:
                    raise ValueError(f"unknown event code {_short(code)}")
                codes[code] += 1
                if code == _SNAPSHOT:
                    step = item[1] if len(item) > 1 else None
                    if type(step) is not int:
                        raise ValueError(f"StepSnapshot.step = {_short(step)} is not valid")
                    steps.append(step)
        except ValueError as e:
            raise TraceError(f"{self.path}: a record does not hold trace events ({e})") from None
        self._check_steps(rec, steps, bool(items) and items[-1][0] == _SNAPSHOT)
