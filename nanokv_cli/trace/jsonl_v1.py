"""Version 1 traces: a JSONL header line, then one event per line (still read, no longer
written; ``export --format jsonl`` writes one)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from ..engine.core.events import CacheState, Event, SequenceAdded, StepSnapshot, event_from_dict
from .budget import ViewBudget
from .checks import _check_event, check_json_lists
from .format import (
    MAX_HEADER_CHARS,
    TRACE_FORMAT,
    TRACE_VERSION,
    TraceError,
    _check_header,
    _OverLimit,
)


class _JsonlTrace:
    """Version 1: a JSONL header line, then one event per line (read-only)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with open(path, encoding="utf-8", errors="replace") as f:
            line = f.readline(MAX_HEADER_CHARS)  # a file of no newlines is not read whole
        try:
            header = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            header = None
        if not isinstance(header, dict) or header.get("format") != TRACE_FORMAT:
            raise TraceError(
                f"{path}: not a nanokv trace (write one with `nanokv replay ... --record FILE`)"
            )
        if header.get("version") != 1:
            raise TraceError(
                f"{path}: trace format version {header.get('version')} is not supported "
                f"(this nanokv reads versions 1 and {TRACE_VERSION})"
            )
        self.model_note = _check_header(path, header, 1)
        self.header = header

    def events(self) -> Iterator[Event]:
        """Every event, under one view's budget (the events and prompt tokens version 2 may
        decode for a view): a view of a huge or forged file ends with one error."""
        # Bytes, decoded line by line: a text file decodes whole chunks, so its error would
        # name the line being read, not the one holding the bad bytes.
        budget = ViewBudget(self.path)
        with open(self.path, "rb") as f:
            f.readline()
            for n, raw in enumerate(f, 2):
                if not raw.endswith(b"\n"):
                    return  # killed mid-line: the file ends at the last whole step
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError:
                    raise TraceError(f"{self.path} line {n}: not UTF-8 text") from None
                if line.strip():
                    yield self._event(line, n, budget)

    def _event(self, line: str, n: int, budget: ViewBudget) -> Event:
        try:
            event = event_from_dict(json.loads(line))
            _check_event(event, self.header["num_blocks"])
            check_json_lists(event)
            budget.spend_events(1)
            if type(event) is SequenceAdded:
                budget.spend_tokens(event.seq_id, len(event.prompt_token_ids))
            return event
        except RecursionError:
            raise TraceError(
                f"{self.path} line {n}: not a trace event (nested too deeply)"
            ) from None
        except TraceError:
            raise
        except _OverLimit as e:
            raise TraceError(f"{self.path} line {n}: {e}") from None
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
            raise TraceError(f"{self.path} line {n}: not a trace event ({e})") from None

    def state_at(self, step: int | None = None) -> CacheState:
        state = CacheState(self.header["num_blocks"])
        last = None
        pending: list[Event] = []
        for event in self.events():
            pending.append(event)
            if type(event) is not StepSnapshot:
                continue
            try:
                state.apply_all(pending)
            except (IndexError, ValueError) as e:
                raise TraceError(
                    f"{self.path}: events do not fit the header's cache ({e})"
                ) from None
            pending.clear()
            last = event.step
            if event.step == step:
                return state
        if last is None:
            raise TraceError(f"{self.path}: the trace holds no steps")
        if step is not None:
            raise TraceError(f"{self.path}: no step {step}; the trace has steps up to {last}")
        return state
