"""Where nanokv keeps what it builds once per machine (compiled CPU kernels)."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """nanokv's cache (compiled CPU kernels): $NANOKV_CACHE_DIR, else $XDG_CACHE_HOME/nanokv,
    else ~/.cache/nanokv."""
    if explicit := os.environ.get("NANOKV_CACHE_DIR"):
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "nanokv"
