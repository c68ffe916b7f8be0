"""Reading a trace: its header at once, any step through the nearest checkpoint, every event,
a summary, and one request's events from before it arrived.

``TraceReader`` puts the pieces of a version-2 file together (its records, prompts, events
records and checkpoints); a version-1 file is read by ``jsonl_v1``."""

from __future__ import annotations

import os
import stat
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..engine.core.cache_numbers import cache_numbers
from ..engine.core.events import CacheState, Event, SequenceAdded, StepSnapshot
from ..paths import kind_of
from .checkpoints import Checkpoints
from .format import _CODES, MAGIC, TraceError, _reason, _short
from .jsonl_v1 import _JsonlTrace
from .prompts import PromptStore
from .records import Record, RecordFile
from .steps import EventRecords

_RECORD_NAMES = {b"H": "header", b"P": "prompts", b"E": "events", b"C": "checkpoints"}


class TraceReader:
    """Reads a trace's header at once, and any step through the nearest checkpoint."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise TraceError(f"{self.path}: no such file")
        if not self.path.is_file():
            raise TraceError(f"{self.path}: not a regular file")
        try:
            with open(self.path, "rb") as f:
                magic = f.read(len(MAGIC))
        except OSError as e:
            raise TraceError(f"{self.path}: {e.strerror}") from None
        self.note: str | None = None  # set when a torn last record was dropped
        self._v1: _JsonlTrace | None = None
        if magic == MAGIC:
            self._file = RecordFile(self.path)
            self.records: list[Record] = self._file.records
            self.header: dict[str, Any] = self._file.header
            self.note = self._file.note
            self._model_note = self._file.model_note
            self._prompts = PromptStore(self._file)
            self._steps = EventRecords(self._file, self._prompts)
            self._checkpoints = Checkpoints(self._file, self._prompts)
        elif magic[:1] == b"{":
            self._v1 = _JsonlTrace(self.path)
            self.header = self._v1.header
            self._model_note = self._v1.model_note
        else:
            raise TraceError(
                f"{self.path}: not a nanokv trace (write one with `nanokv replay ... --record FILE`)"
            )

    def model_path(self) -> tuple[str | None, str | None]:
        """The model the header names, to decode block text with, and None; or None and why
        it cannot be used (the text is then left out). Only a file or a folder is handed on:
        reading a FIFO would block and a device never ends."""
        if self._model_note is not None:
            return None, self._model_note
        model = self.header["model"]
        if model is None:  # a run on token ids only
            return None, None
        try:
            mode = os.stat(Path(model).expanduser()).st_mode
        except (OSError, ValueError) as e:  # ValueError: a NUL in the path
            why = getattr(e, "strerror", None) or str(e)
            return None, f"the trace's model {_short(model)}: {why}"
        if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
            return None, f"the trace's model {_short(model)} is {kind_of(mode)}, not a model"
        return model, None

    @property
    def block_size(self) -> int:
        return self.header["block_size"]

    @property
    def num_blocks(self) -> int:
        return self.header["num_blocks"]

    # -- records and prompts (version 2) -----------------------------------------------------

    def _payload(self, record: Record) -> Any:
        return self._file.payload(record)

    def _prompts_of(self, seq_id: int) -> dict[int, Any]:
        return self._prompts.prompts_of(seq_id)

    def _new_view(self) -> None:
        self._file.budget.new_view()

    def prompt(self, seq_id: int) -> tuple[array, list | None]:
        """A sequence's prompt tokens (a compact array), and its recipe if it was synthesized."""
        return self._prompts.prompt(seq_id)

    def prompt_slice(self, seq_id: int, start: int, end: int) -> list[int]:
        return self._prompts.prompt_slice(seq_id, start, end)

    def was_admitted(self, seq_id: int) -> bool:
        """Whether the events admit ``seq_id``: read only for an id without a prompt, to tell a
        rejected request's (never admitted) from a lost prompt record. The writer puts each
        prompt record right before the events that admit its requests, so only the events
        between the prompt records around the id can."""
        prompts = [i for i, rec in enumerate(self.records) if rec[0] == b"P"]
        before = max((i for i in prompts if self.records[i][2] < seq_id), default=-1)
        after = min((i for i in prompts if self.records[i][1] > seq_id), default=len(self.records))
        for rec in self.records[before + 1 : after]:
            if rec[0] == b"E":
                for event in self._steps.decoded(rec, tokens=False):
                    if type(event) is SequenceAdded and event.seq_id == seq_id:
                        return True
        return False

    def num_requests(self) -> int | None:
        """Requests the trace holds (ids 0 to n - 1); None for a version 1 trace."""
        if self._v1 is not None:
            return None
        return max((rec[2] + 1 for rec in self.records if rec[0] == b"P"), default=0)

    # -- events and states -------------------------------------------------------------------

    def events(self, tokens: bool = True) -> Iterator[Event]:
        """Every event of every whole step, in order. ``tokens=False`` leaves prompts and
        stored blocks' token ids empty, for readers that only follow the books (much faster
        on a long synthesized trace)."""
        if self._v1 is not None:
            yield from self._v1.events()
            return
        self._new_view()
        for rec in self.records:
            if rec[0] == b"E":
                yield from self._steps.decoded(rec, tokens)

    def summary(self) -> dict[str, Any]:
        """Steps, events per type and bytes per record kind, for ``inspect --summary``."""
        counts, last, snapshot = self._count_events()
        records = self.records if self._v1 is None else []
        sizes: dict[str, int] = {}
        for kind, _, _, _, n in records:
            name = _RECORD_NAMES[kind]
            sizes[name] = sizes.get(name, 0) + n
        return {
            "version": self.header.get("version"),
            "steps": 0 if last is None else last + 1,
            "events": counts,
            "num_events": sum(counts.values()),
            "file_bytes": self.path.stat().st_size,
            "record_bytes": sizes,
            "checkpoints": sum(1 for r in records if r[0] == b"C"),
            "requests": self.num_requests(),
            "cache": cache_numbers(snapshot),
        }

    def _count_events(self) -> tuple[dict[str, int], int | None, StepSnapshot | None]:
        """Events per type, the last step, and its snapshot (it carries the run's cache
        counters); a version-2 trace's events are counted by type code, not decoded."""
        counts: dict[str, int] = {}
        last = snapshot = None
        if self._v1 is not None:
            for event in self.events():
                name = type(event).__name__
                counts[name] = counts.get(name, 0) + 1
                if type(event) is StepSnapshot:
                    last, snapshot = event.step, event
            return counts, last, snapshot
        self._new_view()
        codes = [0] * len(_CODES)
        final = None
        for rec in self.records:
            if rec[0] == b"E":
                self._steps.count_codes(rec, codes)
                last, final = rec[2], rec
        counts = {cls.__name__: n for cls, n in zip(_CODES, codes) if n}
        if final is not None:
            snapshot = self._steps.last_snapshot(final)
        return counts, last, snapshot

    def state_at(self, step: int | None = None) -> CacheState:
        """The cache as it stood at the end of ``step`` (default: the last recorded step)."""
        if self._v1 is not None:
            return self._v1.state_at(step)
        self._new_view()
        steps = [r for r in self.records if r[0] == b"E"]
        if not steps:
            raise TraceError(f"{self.path}: the trace holds no steps")
        last = steps[-1][2]
        if step is None:
            step = last
        if step > last:
            raise TraceError(f"{self.path}: no step {step}; the trace has steps up to {last}")
        checkpoint = None
        for rec in self.records:
            if rec[0] == b"C" and rec[1] <= step:
                checkpoint = rec
        state = CacheState(self.num_blocks)
        start = 0
        if checkpoint is not None:
            self._checkpoints.restore(state, checkpoint)
            start = checkpoint[1] + 1
            if start > step:
                return state
        self._replay(state, steps, start, step)
        return state

    def _replay(self, state: CacheState, steps: list[Record], start: int, step: int) -> None:
        """Apply the events of steps ``start`` to ``step`` to ``state``."""
        try:
            for rec in steps:
                if rec[2] < start or rec[1] > step:
                    continue  # records hold whole steps and start right after a checkpoint
                events = self._steps.decoded(rec)
                if rec[2] > step:  # stop at the end of the asked step
                    end = next(
                        i
                        for i, e in enumerate(events)
                        if type(e) is StepSnapshot and e.step == step
                    )
                    events = events[: end + 1]
                state.apply_all(events)
        except TraceError:
            raise  # already says what is wrong
        except (IndexError, ValueError, StopIteration) as e:
            raise TraceError(
                f"{self.path}: events do not fit the header's cache ({_reason(e)})"
            ) from None

    def replay_from(self, seq_id: int) -> tuple[CacheState, Iterator[Event]]:
        """For following one request: the cache state at a checkpoint before the request
        arrived (its block tables; no token ids), and every event from there on."""
        state = CacheState(self.num_blocks)
        if self._v1 is not None:
            return state, self.events()
        self._new_view()
        arrival = 0  # the first step of the events record right after its prompt record
        for i, rec in enumerate(self.records):
            if rec[0] == b"P" and rec[1] <= seq_id <= rec[2]:
                arrival = next((r[1] for r in self.records[i:] if r[0] == b"E"), 0)
                break
        checkpoint = None
        for rec in self.records:
            if rec[0] == b"C" and rec[1] < arrival:
                checkpoint = rec
        start = 0
        if checkpoint is not None:
            self._checkpoints.restore_tables(state, checkpoint)
            start = checkpoint[1] + 1

        def events() -> Iterator[Event]:
            for rec in self.records:
                if rec[0] == b"E" and rec[2] >= start:
                    yield from self._steps.decoded(rec, tokens=False)

        return state, events()
