"""Ctrl-C that ends a run between two engine steps, so that what the run made is kept whole.

A ``KeyboardInterrupt`` raised in the middle of a step leaves everything that listens to the
engine's events a little apart: one listener may have counted a finished request that the next
never saw, so a live view's last frame, the summary and the report could disagree, and the
step's tokens are never handed out. ``StepInterrupt`` takes SIGINT over while a run steps: the
first Ctrl-C only asks the loop to stop after the current step (``requested``); while the loop
waits for work (``waiting()``), or at a second Ctrl-C, it raises ``KeyboardInterrupt`` as usual,
so nothing ever hangs on it.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Any


class StepInterrupt:
    """A context manager; outside the main thread (where no signal handler can be set), or where
    SIGINT has another handler, it does nothing and Ctrl-C acts as it would without it."""

    def __init__(self, waiting: Callable[[], bool] = lambda: False) -> None:
        self.waiting = waiting
        self.requested = False
        self._saved: Any = None

    def __enter__(self) -> StepInterrupt:
        # Only over Python's own handler: an ignored SIGINT (a background job) stays ignored,
        # and a caller's handler stays theirs.
        main = threading.current_thread() is threading.main_thread()
        if main and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._saved = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._saved is not None:
            signal.signal(signal.SIGINT, self._saved)
            self._saved = None

    def _on_sigint(self, signum: int, frame: Any) -> None:
        if self.requested or self.waiting():
            raise KeyboardInterrupt
        self.requested = True
