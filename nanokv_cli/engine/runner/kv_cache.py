"""The KV cache tensor: whether a run fits, how many blocks it holds, its allocation, and its
commit.

One tensor for the whole model (layout in ``layers/attention.py``:
``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``), sized once the weights are
in place - from ``num_blocks``, a ``kv_cache_memory`` budget, a share of the memory the process
may still take (CPU) or what the GPU has left - and allocated uninitialised.
"""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..config import ModelConfig
from .memory import InsufficientMemoryError, format_bytes, memory_limit
from .run_plan import RunPlan

# CPU KV cache budget when none is given: a quarter of the memory the process may still take
# at start-up (the tightest of ulimit -v, the cgroup limit and MemAvailable: memory_limit),
# within these bounds. 1 GiB held ~40 of the throughput benchmark's 64 sequences (SmolLM2,
# float32, block size 256), and the preemptions and smaller batches that followed cost 2x in
# throughput; 4 GiB holds all of them. Pages are only touched as blocks come into use.
DEFAULT_CPU_KV_CACHE_MEMORY = 1 << 30  # bytes, when available memory cannot be read
MIN_CPU_KV_CACHE_MEMORY = 256 << 20
MAX_CPU_KV_CACHE_MEMORY = 4 << 30
# Within that budget, the default CPU cache holds no more than this many sequences at the
# model's full length: what a model can use, not what the machine has free. A server commits
# its whole cache (``commit``), so the budget alone gave SmolLM2-135M a 4 GiB cache and a
# 4.4 GB server for a 98 MB model. Eight of SmolLM2's 8,192-token sequences are 65,536 tokens
# (1.4 GiB), over twice what the throughput benchmark's 64 sequences hold at their peak (109
# blocks of 256: a dry run of its requests), so its batches stay whole and unpreempted;
# --kv-cache-memory or --num-blocks give more.
DEFAULT_CPU_FULL_SEQUENCES = 8


class CacheSize(NamedTuple):
    """How many blocks a cache holds, and what decided it (said at start-up)."""

    num_blocks: int
    source: str


@dataclass(frozen=True)
class CacheShape:
    """What one rank's cache holds per block."""

    num_layers: int
    num_kv_heads: int  # on this rank
    head_dim: int
    block_size: int
    dtype: torch.dtype
    device: torch.device

    @property
    def block_bytes(self) -> int:
        """Bytes of KV cache one block takes on this rank (all layers, K and V)."""
        per_token = 2 * self.num_layers * self.num_kv_heads * self.head_dim
        return per_token * self.block_size * self.dtype.itemsize


def check_memory_fits(config: ModelConfig, plan: RunPlan) -> None:
    """Refuse, before anything is built, a run that cannot fit: the weights, the RoPE table
    and the smallest KV cache asked for (``num_blocks``, else one block) against
    ``memory_limit``. A lower bound, so it never refuses a run that would fit: quantized
    weights count only against RLIMIT_AS (the float copy is reserved, never touched), K/V at
    2 bytes. ``count_blocks`` checks the exact cache once the weights are in place.
    """
    limit = memory_limit(plan.device)
    if limit is None:
        return
    quantization, tp_size, max_len = plan.quantization, plan.tp_size, plan.max_model_len
    weights = 0
    if quantization is None or limit.counts_reserved:
        weights = config.parameter_count() * plan.dtype.itemsize // tp_size
    # cos/sin [max_len, 2, head_dim] float32, computed through ~3x that in temporaries.
    rope = 3 * max_len * 2 * config.head_dim * 4
    kv_heads = -(-config.num_key_value_heads // tp_size)
    block = 2 * config.num_hidden_layers * kv_heads * config.head_dim * 2 * plan.block_size
    kv = block * (plan.num_blocks or 1)
    if weights + rope + kv <= limit.free:
        return
    if kv >= max(weights, rope):
        hint = (
            f"lower --num-blocks ({plan.num_blocks}) or --block-size"
            if plan.num_blocks
            else f"lower --block-size ({plan.block_size})"
        )
    elif rope >= weights:
        hint = f"lower --max-model-len ({max_len})"
    else:
        quantized = "" if quantization else ", a quantized GGUF file"
        hint = f"use a smaller model{quantized} or raise the limit"
    parts = {"weights": weights, "RoPE table": rope, "KV cache": kv}
    shown = ", ".join(f"{name} {format_bytes(size)}" for name, size in parts.items() if size)
    raise InsufficientMemoryError(
        f"this run needs at least {format_bytes(weights + rope + kv)} ({shown}) but only "
        f"{format_bytes(max(limit.free, 0))} is free under {limit.source}: {hint}"
    )


def count_blocks(shape: CacheShape, plan: RunPlan, gpu_budget: int | None = None) -> CacheSize:
    """The blocks this rank's cache holds, and why. ``gpu_budget``: the bytes a GPU has left for
    it (``needs_gpu_budget``: measured after a warm-up, on CUDA without a size given).

    Raises InsufficientMemoryError, naming the flag to change, for a cache that cannot hold one
    block or that the user sized past the memory the process may still take.
    """
    if plan.num_blocks is not None:
        _check_fits(shape, plan.num_blocks, "--num-blocks", str(plan.num_blocks))
        return CacheSize(plan.num_blocks, "--num-blocks")
    memory = plan.kv_cache_memory
    cpu_default = False  # the budget is the CPU default's, which the model's use caps (above)
    if needs_gpu_budget(shape, plan):  # pragma: no cover - GPU
        assert gpu_budget is not None, "a CUDA cache without a size needs the GPU's budget"
        budget = gpu_budget
        source = (
            f"{plan.gpu_memory_utilization:g} of {shape.device}'s memory less what is in "
            "use and a step's activations"
        )
    elif memory is None:
        budget, source = default_cpu_budget()
        cpu_default = True
    else:
        budget, source = memory, f"--kv-cache-memory {format_bytes(memory)}"
    if budget < shape.block_bytes:
        if memory is not None:
            budget_is, fix = f"--kv-cache-memory {format_bytes(budget)}", "raise it"
        else:  # the default: a share of what the process may still take
            limit = memory_limit(shape.device)
            budget_is = f"the default KV cache memory of {format_bytes(budget)}"
            fix = f"raise {limit.source}" if limit else "set --kv-cache-memory"
        raise InsufficientMemoryError(
            f"{budget_is} cannot hold a single block "
            f"({format_bytes(shape.block_bytes)} for block size {shape.block_size}): lower "
            f"--block-size or {fix}"
        )
    # More blocks than every admissible sequence at full length could never be used; by
    # default on CPU, no more than DEFAULT_CPU_FULL_SEQUENCES of them (see above).
    sequences, why = plan.max_num_seqs, f"--max-num-seqs {plan.max_num_seqs}"
    if cpu_default and sequences > DEFAULT_CPU_FULL_SEQUENCES:
        sequences, why = DEFAULT_CPU_FULL_SEQUENCES, "the default"
    max_model_len = plan.max_model_len
    ceiling = sequences * -(-max_model_len // shape.block_size)
    num_blocks = min(budget // shape.block_bytes, ceiling)
    if memory is not None:
        _check_fits(shape, num_blocks, "--kv-cache-memory", format_bytes(memory))
    if num_blocks == ceiling:
        plural = "s" * (sequences != 1)
        room = f"room for {sequences} sequence{plural} of the model's {max_model_len:,} tokens"
        source = f"{room} ({why}), within {source}"
    return CacheSize(num_blocks, source)


def needs_gpu_budget(shape: CacheShape, plan: RunPlan) -> bool:
    """Whether ``count_blocks`` sizes this cache from what the GPU has left."""
    no_size = plan.num_blocks is None and plan.kv_cache_memory is None
    return shape.device.type == "cuda" and no_size


def _check_fits(shape: CacheShape, num_blocks: int, flag: str, value: str) -> None:
    """A cache the user sized must fit in what the process may still take: the weights are in
    place by now, so the limit's headroom is what is left for it."""
    limit = memory_limit(shape.device)
    size = num_blocks * shape.block_bytes
    if limit is None or size <= limit.free:
        return
    raise InsufficientMemoryError(
        f"{flag} {value} asks for a {format_bytes(size)} KV cache ({num_blocks} blocks of "
        f"{format_bytes(shape.block_bytes)}) but only {format_bytes(max(limit.free, 0))} "
        f"is free under {limit.source}: lower {flag} (or --block-size)"
    )


def allocate(shape: CacheShape, blocks: int) -> torch.Tensor:
    """The cache tensor of ``blocks`` blocks, uninitialised: a 1 GiB torch.zeros costs ~1 s of
    page faults at start-up, and no read ever touches a slot before it is written (decode
    padding reads a written slot)."""
    dims = (shape.num_layers, 2, blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
    try:
        return torch.empty(*dims, dtype=shape.dtype, device=shape.device)
    except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
        raise InsufficientMemoryError(
            f"could not allocate the {format_bytes(blocks * shape.block_bytes)} KV cache "
            f"({blocks} blocks) on {shape.device} ({str(e).splitlines()[0][:120]}): lower "
            "--num-blocks or --kv-cache-memory"
        ) from None


def commit(kv_cache: torch.Tensor) -> None:
    """Write every page of a CPU KV cache now, for a process that will keep it (a server).

    The cache is allocated uninitialised, so its pages are faulted in as blocks are first
    used, and the free queue hands out never-used blocks before reused ones: a server's RSS
    then climbs for as long as the cache has untouched blocks. Committed at start-up, the
    memory is all there from the first request, and a cache the machine cannot hold fails
    here, not under load. Huge pages where the kernel grants them (madvise): 4 GiB commits in
    ~0.5 s instead of 1.2-2.5 s of 4 KiB page faults here, and attention's reads need fewer
    TLB entries.
    """
    if kv_cache.device.type != "cpu":
        return
    advise_huge_pages(kv_cache)
    kv_cache.zero_()


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask Linux for transparent huge pages over a large CPU tensor's whole 2 MiB pages
    (``madvise(MADV_HUGEPAGE)``; THP's "madvise" mode grants them only so); whether it was."""
    huge, madv_hugepage = 2 << 20, 14
    start = -(-tensor.data_ptr() // huge) * huge
    end = (tensor.data_ptr() + tensor.nbytes) // huge * huge
    if not sys.platform.startswith("linux") or end <= start:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc.madvise(start, end - start, madv_hugepage) == 0
    except (OSError, AttributeError):  # not glibc
        return False


def default_cpu_kv_cache_memory() -> int:
    """Bytes for the CPU KV cache: a quarter of what the process may still take, clamped (see
    above), and never over half of it: under a tight ``ulimit -v`` or cgroup limit the
    minimum gives way rather than the allocation failing."""
    return default_cpu_budget()[0]


def default_cpu_budget() -> tuple[int, str]:
    """``default_cpu_kv_cache_memory`` and how it came about, in words for the start-up line."""
    limit = memory_limit(torch.device("cpu"))
    if limit is None:
        default = format_bytes(DEFAULT_CPU_KV_CACHE_MEMORY)
        return DEFAULT_CPU_KV_CACHE_MEMORY, f"the default {default} (free memory is unknown)"
    free = limit.free
    of = f"the {format_bytes(max(free, 0))} this process may take ({_short(limit.source)})"
    if free // 2 < MIN_CPU_KV_CACHE_MEMORY:
        return max(0, free // 2), f"half of {of}"
    if free // 4 > MAX_CPU_KV_CACHE_MEMORY:
        return (
            MAX_CPU_KV_CACHE_MEMORY,
            f"the {format_bytes(MAX_CPU_KV_CACHE_MEMORY)} cap on a quarter of {of}",
        )
    if free // 4 < MIN_CPU_KV_CACHE_MEMORY:
        return (
            MIN_CPU_KV_CACHE_MEMORY,
            f"the {format_bytes(MIN_CPU_KV_CACHE_MEMORY)} floor under a quarter of {of}",
        )
    return free // 4, f"a quarter of {of}"


def _short(source: str) -> str:
    """A limit's name without its figures (``the cgroup memory limit of 8 GiB (/sys/...)``)."""
    return source.split(" of ", 1)[0].removeprefix("the ")
