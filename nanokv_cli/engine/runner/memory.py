"""How much memory a run may use: the tightest of the process's address-space limit
(``ulimit -v``), its cgroup's limit and the memory available, so a cache or a model too big
fails with one message that says what to lower instead of a traceback or the OOM killer
(``kv_cache.check_memory_fits``, before anything is allocated)."""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch only where a GPU is asked about: dry runs stay free of it
    import torch


class InsufficientMemoryError(ValueError):
    """The run asks for more memory than the process may use; the message says what to lower."""


@dataclass(frozen=True)
class MemoryLimit:
    """Bytes the process may still take, and the limit that says so (named in messages)."""

    free: int
    source: str
    # RLIMIT_AS counts reserved address space, touched or not; the others count pages in use.
    counts_reserved: bool = False


# cgroup v2 and v1: (mount, limit file, usage file, reclaimable page cache in memory.stat).
_CGROUP_FILES = {
    "": ("/sys/fs/cgroup", "memory.max", "memory.current", "inactive_file"),
    "memory": (
        "/sys/fs/cgroup/memory",
        "memory.limit_in_bytes",
        "memory.usage_in_bytes",
        "total_inactive_file",
    ),
}


def memory_limit(device: torch.device) -> MemoryLimit | None:
    """The tightest limit on what this process may still allocate on ``device``: CUDA, the
    device's free memory; CPU, ``host_memory_limit``."""
    if device.type == "cuda":  # pragma: no cover - GPU
        import torch

        free, _ = torch.cuda.mem_get_info(device)
        return MemoryLimit(free, f"the free memory of {device}")
    return host_memory_limit()


def host_memory_limit() -> MemoryLimit | None:
    """The tightest of: the address-space limit (RLIMIT_AS, ``ulimit -v``) less the address
    space in use, the cgroup's limit (and its ancestors') less its usage, and MemAvailable.
    None when none can be read. Reads /proc and /sys only (no torch)."""
    return min(memory_limits(), key=lambda x: x.free, default=None)


def memory_limits() -> list[MemoryLimit]:
    """Each limit that applies here (address space, cgroup, MemAvailable), for reports."""
    limits = (_address_space_limit(), _cgroup_limit(), _available_memory())
    return [x for x in limits if x is not None]


def release_freed_memory() -> None:
    """Hand memory freed to glibc back to the OS (``malloc_trim``). A CPU run pins glibc's
    thresholds so it keeps what it frees (``run_plan.keep_freed_memory``): right for a decode
    step's buffers, used again at once, but a one-off burst (packing weights, tokenizing a
    huge text) would then stay in the process for good."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def format_bytes(size: int) -> str:
    """``5905580032`` -> ``"5.5 GiB"``, for messages."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if size >= 1 << shift:
            return f"{size / (1 << shift):.1f} {unit}"
    return f"{size} bytes"


def _address_space_limit() -> MemoryLimit | None:
    try:
        import resource
    except ImportError:  # not POSIX
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    used = _proc_kib("/proc/self/status", "VmSize")
    if soft == resource.RLIM_INFINITY or used is None:
        return None
    source = f"the address-space limit (ulimit -v) of {format_bytes(soft)}"
    return MemoryLimit(soft - used, source, counts_reserved=True)


def _available_memory() -> MemoryLimit | None:
    available = _proc_kib("/proc/meminfo", "MemAvailable")
    return None if available is None else MemoryLimit(available, "available memory")


def _proc_kib(path: str, key: str) -> int | None:
    """Bytes of a ``key:  N kB`` line of a /proc file; None where there is none."""
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(":")
                if name == key:
                    return int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_limit() -> MemoryLimit | None:
    """The tightest memory limit of this process's cgroup and its ancestors (v2 or v1)."""
    try:
        with open("/proc/self/cgroup") as f:
            entries = [line.strip().split(":", 2) for line in f if line.count(":") >= 2]
    except OSError:
        return None
    tightest = None
    for _, controllers, path in entries:
        key = "" if controllers == "" else "memory"
        if key == "memory" and "memory" not in controllers.split(","):
            continue
        mount, limit_file, usage_file, reclaimable = _CGROUP_FILES[key]
        group = Path(mount) / path.lstrip("/")
        # Outside a cgroup namespace the path is the host's: only the mount's own files exist.
        for folder in [group, *group.parents]:
            if not folder.is_relative_to(mount):
                break
            limit = _cgroup_free(folder, limit_file, usage_file, reclaimable)
            if limit is not None and (tightest is None or limit.free < tightest.free):
                tightest = limit
    return tightest


def _cgroup_free(
    folder: Path, limit_file: str, usage_file: str, reclaimable: str
) -> MemoryLimit | None:
    try:
        limit_text = (folder / limit_file).read_text().strip()
        if limit_text == "max" or int(limit_text) >= 1 << 60:  # v1 writes ~2**63 for none
            return None
        limit, usage = int(limit_text), int((folder / usage_file).read_text())
        stat = dict(line.split()[:2] for line in (folder / "memory.stat").read_text().splitlines())
    except (OSError, ValueError):
        return None
    # Page cache the kernel reclaims before failing an allocation counts as free.
    free = limit - usage + int(stat.get(reclaimable, 0))
    source = f"the cgroup memory limit of {format_bytes(limit)} ({folder / limit_file})"
    return MemoryLimit(free, source)
