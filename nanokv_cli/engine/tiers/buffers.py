"""A block's bytes as buffers the OS can read into and write from, and vectored file I/O.

A block of the cache, ``kv[:, :, b]``, is not contiguous: it is ``num_layers * 2`` runs of
``block_size * num_kv_heads * head_dim`` elements, one per layer and K/V. Handing those runs
to ``preadv``/``pwritev`` moves a block between file and cache in one system call with no
copy in between; a staging copy is needed only for device tensors or odd strides.
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch

try:
    IOV_MAX = max(16, os.sysconf("SC_IOV_MAX"))
except (AttributeError, ValueError, OSError):
    IOV_MAX = 16  # POSIX's minimum guarantee
# Past this many runs a staging copy (one memcpy) costs less than the per-run bookkeeping.
MAX_RUNS = 512

_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def byte_runs(tensor: torch.Tensor, max_runs: int = MAX_RUNS) -> list[memoryview] | None:
    """Writable byte views of ``tensor``'s memory, in C order of its elements (so a block
    reads the same whatever its strides), as few runs as the strides allow. None when the
    tensor is not in CPU memory or would need more than ``max_runs`` runs."""
    if tensor.device.type != "cpu" or tensor.element_size() not in _SAME_SIZE_INT:
        return None
    shape, strides = tensor.shape, tensor.stride()
    # The trailing dimensions that are laid out densely form one run per leading index.
    split, dense = tensor.dim(), 1
    for dim in range(tensor.dim() - 1, -1, -1):
        if shape[dim] != 1 and strides[dim] != dense:
            break
        dense *= shape[dim]
        split = dim
    leading = tuple(shape[:split])
    if math.prod(leading) > max_runs:
        return None
    # numpy has no bfloat16: an integer view of the same width shares the memory.
    array = tensor.detach().view(_SAME_SIZE_INT[tensor.element_size()]).numpy()
    runs = []
    for index in np.ndindex(*leading):
        flat = array[index].reshape(-1)
        # reshape copies when it cannot view; a copy would swallow what is read into it.
        if flat.size and not np.may_share_memory(flat, array):
            return None
        runs.append(memoryview(flat.view(np.uint8)))
    return runs


def staging_like(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A contiguous CPU buffer for blocks that cannot be read or written in place; pinned when
    it feeds a CUDA copy and pinning works (it fails without a driver)."""
    if pin and torch.cuda.is_available():
        try:
            return torch.empty(shape, dtype=dtype, pin_memory=True)
        except RuntimeError:
            pass  # out of pinnable memory: pageable memory copies slower but works
    return torch.empty(shape, dtype=dtype)


def _after(buffers: list[memoryview], done: int) -> list[memoryview]:
    """What is left of ``buffers`` after the first ``done`` bytes went through."""
    for i, buffer in enumerate(buffers):
        if done < buffer.nbytes:
            return [buffer[done:], *buffers[i + 1 :]]
        done -= buffer.nbytes
    return []


def write_all(fd: int, buffers: list[memoryview], offset: int) -> None:
    """Write ``buffers`` back to back at ``offset``; OSError on failure. A short write (a
    signal, a nearly full disk) continues where it stopped, so this either writes everything
    or raises."""
    while buffers:
        chunk = buffers[:IOV_MAX]
        if hasattr(os, "pwritev"):
            written = os.pwritev(fd, chunk, offset)
        else:
            written = os.pwrite(fd, chunk[0], offset)
        if written <= 0:
            raise OSError(f"wrote nothing at offset {offset}")
        offset += written
        buffers = _after(buffers, written)


def read_all(fd: int, buffers: list[memoryview], offset: int) -> bool:
    """Fill ``buffers`` back to back from ``offset``; False when the file ends first (a
    truncated file), OSError when reading fails."""
    while buffers:
        chunk = buffers[:IOV_MAX]
        if hasattr(os, "preadv"):
            count = os.preadv(fd, chunk, offset)
        else:
            data = os.pread(fd, chunk[0].nbytes, offset)
            chunk[0][: len(data)] = data
            count = len(data)
        if count == 0:
            return False
        offset += count
        buffers = _after(buffers, count)
    return True
