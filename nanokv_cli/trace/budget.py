"""The budget of one view (a step, the summary, a request, an export): the most events and
prompt tokens it may decode, however many a file declares."""

from __future__ import annotations

from pathlib import Path

from .format import (
    MAX_RECORD_EVENTS,
    MAX_VIEW_EVENTS,
    MAX_VIEW_PROMPT_TOKENS,
    TraceError,
    _OverLimit,
)


class ViewBudget:
    """What is left of the view being read; ``new_view`` starts the next one."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.new_view()

    def new_view(self) -> None:
        self._events_left = MAX_VIEW_EVENTS
        self._tokens_left = MAX_VIEW_PROMPT_TOKENS

    def spend_events(self, n: int) -> None:
        """Count an events record's events against the view's budget, before it is unpacked."""
        if n > MAX_RECORD_EVENTS:
            raise _OverLimit(f"holds {n:,} events; the limit is {MAX_RECORD_EVENTS:,}")
        if n > self._events_left:
            raise _OverLimit(
                f"is past the {MAX_VIEW_EVENTS:,} events one view may read (the trace holds more)"
            )
        self._events_left -= n

    def spend_tokens(self, seq_id: int, n: int) -> None:
        if n > self._tokens_left:
            raise TraceError(
                f"{self.path}: the prompt of sequence {seq_id} is past the "
                f"{MAX_VIEW_PROMPT_TOKENS:,} prompt tokens one view may make"
            )
        self._tokens_left -= n
