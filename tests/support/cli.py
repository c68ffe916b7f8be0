"""The command line in a subprocess under an address-space limit and a timeout: how the hostile
input tests meet a run that would blow up (memory) or hang."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

# The checkout: the nearest folder above holding pyproject.toml.
REPO = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
# Address space of a run: inspect and dry runs stay off torch and work under 1 GiB; a model
# run (torch and a tiny model) takes ~1.3 GiB. What the findings blew up to was 2 to 40 GB.
NO_MODEL_MEMORY = 3 << 29
MODEL_MEMORY = 4 << 30
TIMEOUT_S = 60  # a case takes a second or a few; a hang would take forever


def run_limited(
    args: list,
    memory: int = NO_MODEL_MEMORY,
    code: str | None = None,
    cwd: Path = REPO,
    timeout: float = TIMEOUT_S,
) -> subprocess.CompletedProcess:
    """``nanokv ARGS`` (or ``python -c CODE ARGS``) in a subprocess under the limits."""

    def limit_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    command = [sys.executable, *(["-c", code] if code else ["-m", "nanokv_cli.cli"])]
    return subprocess.run(
        [*command, *map(str, args)],
        cwd=cwd,
        env={**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "160"},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        errors="replace",
        timeout=timeout,
        preexec_fn=limit_memory,
    )
