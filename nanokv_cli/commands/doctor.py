"""``nanokv doctor``: what this install and machine give nanokv (``nanokv_cli.doctor``)."""

from __future__ import annotations

import typer

from .errors import user_errors
from .options import JsonOpt
from .output import print_json


def doctor(json_out: JsonOpt = False) -> None:
    """Check this install and machine: kernels, compiler, threads, memory, model.

    Each line says `ok`, `warn` or `fail` with what to do, or `info` for an optional part.
    The CPU kernels are loaded (built first if the cache has none). Exits 1 if a line fails.

    **Examples**

    ```
    nanokv doctor
    nanokv doctor --json
    ```
    """
    from ..doctor import as_json, render, run_checks

    with user_errors(False):
        checks = run_checks()
    if json_out:
        print_json(as_json(checks))
    else:
        print(render(checks))
    if any(c.status == "fail" for c in checks):
        raise typer.Exit(1)
