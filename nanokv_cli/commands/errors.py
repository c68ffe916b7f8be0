"""User errors: one line on stderr and exit 1, where a bug keeps its traceback."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import typer

from ..engine.model.loader import ModelLoadError


class CliError(Exception):
    """A problem with the user's input or environment: one line on stderr, exit 1."""


# Exceptions that mean "the input was wrong", not "nanokv has a bug": shown as one line.
# ValueError covers the engine's RequestRejected, MalformedTraceError, UnsupportedModelError,
# TokenizerError, the driver's RunError and SamplingParams' checks; OSError covers missing and
# unreadable files. MemoryError: the input asked for more than the machine has (the message
# says how much).
USER_ERRORS: tuple[type[BaseException], ...] = (
    CliError,
    ValueError,
    OSError,
    ModelLoadError,
    MemoryError,
)


@contextmanager
def user_errors(debug: bool) -> Iterator[None]:
    """Turn user errors into one line and exit 1, Ctrl-C into exit 130."""
    try:
        yield
    except KeyboardInterrupt:
        print("nanokv: interrupted", file=sys.stderr)
        raise typer.Exit(130) from None
    except typer.Exit:
        raise
    except Exception as e:
        if not isinstance(e, USER_ERRORS) and not _is_worker_failure(e):
            raise
        if debug:
            raise
        print(f"nanokv: error: {one_line(e)}", file=sys.stderr)
        raise typer.Exit(1) from None


def _is_worker_failure(e: Exception) -> bool:
    """A tensor-parallel worker died: the user's environment, not a nanokv bug."""
    dist = sys.modules.get("nanokv_cli.engine.parallel.distributed")  # loaded only with a TP model
    return dist is not None and isinstance(e, dist.TensorParallelError)


def one_line(e: BaseException) -> str:
    """An error as the one line a user sees."""
    if isinstance(e, MemoryError):
        detail = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return "out of memory" + (f" ({detail})" if detail else "")
    if isinstance(e, FileNotFoundError) and e.filename:
        return f"{e.filename}: no such file"
    if isinstance(e, OSError) and e.strerror:
        return f"{e.filename or ''}: {e.strerror}".lstrip(": ")
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
