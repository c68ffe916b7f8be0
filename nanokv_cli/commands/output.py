"""Where commands print: stdout for results, stderr for progress and notes."""

from __future__ import annotations

import sys
from typing import Any

from rich.console import Console


def stdout_console() -> Console:
    return Console(highlight=False)


def stderr_console() -> Console:
    return Console(stderr=True, highlight=False)


def print_json(obj: Any) -> None:
    from ..run.stats import json_text  # NaN and infinities as null: JSON has neither

    sys.stdout.write(json_text(obj))
    sys.stdout.flush()
