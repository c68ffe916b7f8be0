"""Every decision about how a model runs, made once: the ``RunPlan``.

``resolve_plan`` turns an ``EngineConfig``, the model and this machine into the device, the
dtypes of the weights and of the KV cache, the quantization that runs, the thread count and the
attention back end. It decides in two stages, each decision in one of them: what the machine
decides (``resolve_machine``: checked before a model is read, so a bad device fails at once),
then what the model adds (``MachinePlan.for_model``: its length limit, a file's own blocks). The model runner and each tensor-parallel worker are built from a plan and
read it; nothing downstream resolves a setting again or keeps a path flag of its own. A test
forces a variant by building a runner from ``dataclasses.replace(plan, ...)``.

The process-wide settings a run needs (torch's thread pool, glibc's allocator thresholds, the
current CUDA device) are applied in one place, ``apply_process_settings``.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

import torch

from ..config import EngineConfig, ModelConfig
from ..cpu import kernels as cpu_kernels
from ..cpu.formats import exact_format
from ..layers.attention import flash_attn_with_kvcache
from ..layers.tp import tp_rank
from ..layers.tp import tp_size as _tp_size
from ..model.quantize import check_quantization
from . import triton_attention

# paged-c: the CPU's C kernel reads K/V in place for every query row (float32, kernels built);
# sdpa: torch gathers K/V and calls SDPA (any device); flash: flash-attn's paged kernels (CUDA);
# triton: our Triton kernel reads K/V in place for every row (CUDA; CPU under its interpreter).
AttentionKind = Literal["paged-c", "sdpa", "flash", "triton"]
_HALF = (torch.float16, torch.bfloat16)
GRAPH_BACKENDS = ("flash", "triton")  # decode steps captured as CUDA graphs (cuda_graphs.py)

_DTYPE_NAMES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float64": torch.float64,  # for exactness checks of the reduced-precision code paths
}


@dataclass(frozen=True)
class MachinePlan:
    """What this machine and rank decide, before the model is read (``resolve_machine``)."""

    device: torch.device
    dtype: torch.dtype  # weights and activations
    # The mode this machine runs: "auto", "int8", "int4", or None (float). ``for_model`` turns
    # "auto" into None for a file with no blocks a CPU format holds.
    quantization: str | None
    threads: int  # torch's and the C kernels' threads on this rank
    tp_rank: int
    tp_size: int
    attention: AttentionKind
    # Decode steps run as one recorded C program (cpu/kernels.py StepProgram), float layers as
    # FloatLinear so the program replays them: the CPU kernels on one rank.
    fused_decoder: bool
    cuda_graphs: bool  # decode steps replay captured CUDA graphs (flash, triton; CUDA)

    @property
    def cpu_kernels(self) -> bool:
        """The CPU's C kernels serve attention, norms, rotary and K/V stores."""
        return self.attention == "paged-c"

    @property
    def float_kernels(self) -> bool:
        """Float projections and LM head run as ``FloatLinear``, the C product for every row
        count, so a recorded decode step replays them and a row's bits do not depend on its
        batch (the CPU kernels on one rank; a test that unfuses the decoder keeps them)."""
        return self.cpu_kernels and self.tp_size == 1

    def for_model(
        self,
        model: ModelConfig,
        settings: EngineConfig,
        quantized_blocks: Mapping[str, Any] | None = None,
    ) -> RunPlan:
        """The whole plan, for ``model`` and a file's own ``quantized_blocks`` (by tensor
        name; ``auto`` runs them as they are)."""
        quantization = self.quantization
        if quantization == "auto" and not _holds_exact_blocks(quantized_blocks or {}):
            quantization = None
        machine = {f.name: getattr(self, f.name) for f in fields(MachinePlan)}
        return RunPlan(
            **{**machine, "quantization": quantization},
            kv_cache_dtype=self._kv_cache_dtype(settings.kv_cache_dtype, quantization),
            block_size=settings.block_size,
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            max_model_len=settings.model_len(model.max_position_embeddings),
            num_blocks=settings.num_blocks,
            kv_cache_memory=settings.kv_cache_memory,
            gpu_memory_utilization=settings.gpu_memory_utilization,
        )

    def _kv_cache_dtype(self, setting: str | None, quantization: str | None) -> torch.dtype:
        paged_half = self.cpu_kernels and cpu_kernels.half_cache_supported()
        if setting in (None, "auto"):
            # ``auto`` computes as llama.cpp does, and like llama.cpp keeps K/V in float16: a
            # batched decode step spends ~40% of its time reading float32 K/V (SmolLM2, 64
            # sequences of ~450 tokens), and the cache holds twice the tokens. Other modes
            # keep the model's dtype (``none`` stays float32 end to end, as transformers).
            return torch.float16 if quantization == "auto" and paged_half else self.dtype
        kv = resolve_dtype(setting, self.device)
        # Only the CPU kernels read a cache whose dtype differs from the compute dtype (they
        # convert float16 in hardware, F16C); SDPA and flash-attn take one dtype.
        if kv != self.dtype and not (kv == torch.float16 and paged_half):
            raise ValueError(
                f"kv_cache_dtype {setting!r} with {str(self.dtype).removeprefix('torch.')} "
                "weights: a K/V dtype other than the weights' runs on the CPU kernels in "
                "float16 only; drop --kv-cache-dtype or match --dtype"
            )
        return kv


@dataclass(frozen=True)
class RunPlan(MachinePlan):
    """How this rank runs the model: what ``resolve_plan`` decided, read by everything after.
    ``quantization`` is what runs."""

    kv_cache_dtype: torch.dtype
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    # The cache size asked for, which the runner turns into blocks once the weights are in
    # place (kv_cache.py count_blocks): blocks, else a budget in bytes, else by default.
    num_blocks: int | None
    kv_cache_memory: int | None
    gpu_memory_utilization: float  # the GPU's share a CUDA cache sized by default may fill


def resolve_plan(
    model: ModelConfig,
    settings: EngineConfig,
    *,
    quantized_blocks: Mapping[str, Any] | None = None,
) -> RunPlan:
    """The plan for ``model`` on this rank (the torch.distributed rank, 0 without a group):
    ``resolve_machine(settings).for_model(...)``."""
    return resolve_machine(settings).for_model(model, settings, quantized_blocks)


def resolve_machine(settings: EngineConfig, tp_size: int | None = None) -> MachinePlan:
    """What ``settings`` mean on this machine, for this torch.distributed rank (``tp_size``:
    the ranks there will be, before their group exists). Checked before anything is loaded:
    raises ValueError for a device this machine lacks or a quantization it cannot run."""
    rank, size = tp_rank(), tp_size or _tp_size()
    device = resolve_device(settings.device, rank)
    dtype = resolve_dtype(settings.dtype, device)
    attention = choose_attention(
        settings.attention_backend, device, dtype, settings.block_size, AttentionKernels.here()
    ).kind
    return MachinePlan(
        device=device,
        dtype=dtype,
        quantization=check_quantization(settings.quantization, device, size),
        # Given threads win; by default never more than this process may run on, nor more
        # than the caller already set torch to (a benchmark's or a test's --threads 1).
        threads=settings.threads or min(torch.get_num_threads(), settings.thread_count()),
        tp_rank=rank,
        tp_size=size,
        attention=attention,
        fused_decoder=attention == "paged-c" and size == 1,
        cuda_graphs=captures_graphs(attention, device, settings.enforce_eager),
    )


def apply_process_settings(plan: RunPlan) -> None:
    """Set what a run needs process-wide, once, before any work: torch's pool and the C kernels
    (cpu/kernels.py reads torch.get_num_threads()) run ``plan.threads`` threads from here on;
    on CPU glibc keeps freed memory (``keep_freed_memory``); on CUDA the rank's device is
    current."""
    torch.set_num_threads(plan.threads)
    if plan.device.type == "cpu":
        keep_freed_memory()
    elif plan.device.type == "cuda":  # pragma: no cover - GPU
        torch.cuda.set_device(plan.device)


def _holds_exact_blocks(blocks: Mapping[str, Any]) -> bool:
    # The blocks quantize.pack_model takes as they are under "auto".
    return any(exact_format(b.qtype) is not None for b in blocks.values())


def captures_graphs(attention: AttentionKind, device: torch.device, enforce_eager: bool) -> bool:
    """Whether decode steps replay captured CUDA graphs (cuda_graphs.py): on CUDA, for the
    back ends whose decode metadata the graphs hold, unless ``--enforce-eager``."""
    return device.type == "cuda" and attention in GRAPH_BACKENDS and not enforce_eager


@dataclass(frozen=True)
class AttentionKernels:
    """The attention kernels an install has: ``choose_attention``'s view of the machine, so a
    test can pose any (a CUDA machine without flash-attn) without one."""

    cpu_kernels: bool  # the C kernels are built
    flash_attn: bool  # flash-attn imports
    triton: bool  # triton is installed
    triton_interpreter: bool  # TRITON_INTERPRET=1: Triton runs kernels on CPU tensors

    @classmethod
    def here(cls) -> AttentionKernels:
        return cls(
            cpu_kernels=cpu_kernels.available(),
            flash_attn=flash_attn_with_kvcache is not None,
            triton=triton_attention.available(),
            triton_interpreter=triton_attention.interpreted(),
        )


@dataclass(frozen=True)
class AttentionChoice:
    kind: AttentionKind
    reason: str  # why, in words (``nanokv doctor`` prints it)


def choose_attention(
    setting: str,
    device: torch.device,
    dtype: torch.dtype,
    block_size: int,
    kernels: AttentionKernels,
) -> AttentionChoice:
    """The attention back end for ``--attention-backend setting`` on ``device``. ``auto``: on
    CUDA flash-attn where it serves (installed, half precision, pages of a multiple of 256
    tokens), else our Triton kernel, else SDPA; on CPU the C kernel in float32, else SDPA.
    Raises ValueError, saying why, for a back end that cannot run there."""
    if setting == "auto":
        return _auto_attention(device, dtype, block_size, kernels)
    problem = _attention_problem(setting, device, dtype, block_size, kernels)
    if problem:
        raise ValueError(f"--attention-backend {setting}: {problem}")
    return AttentionChoice(setting, "chosen by --attention-backend")  # type: ignore[arg-type]


def _auto_attention(
    device: torch.device, dtype: torch.dtype, block_size: int, kernels: AttentionKernels
) -> AttentionChoice:
    if device.type == "cpu":
        if _attention_problem("paged-c", device, dtype, block_size, kernels) is None:
            return AttentionChoice("paged-c", "float32 on CPU: the C kernel reads K/V in place")
        return AttentionChoice("sdpa", "on CPU the C kernel serves float32 only, when built")
    no_flash = _attention_problem("flash", device, dtype, block_size, kernels)
    if no_flash is None:
        return AttentionChoice(
            "flash", f"flash-attn is installed and serves block size {block_size}"
        )
    if _attention_problem("triton", device, dtype, block_size, kernels) is None:
        return AttentionChoice("triton", no_flash)
    return AttentionChoice("sdpa", f"{no_flash}, and triton is not installed")


def _attention_problem(
    kind: str, device: torch.device, dtype: torch.dtype, block_size: int, k: AttentionKernels
) -> str | None:
    """Why back end ``kind`` cannot run here, or None."""
    name = str(dtype).removeprefix("torch.")
    if kind == "paged-c":
        if device.type != "cpu" or dtype != torch.float32:
            return f"the C kernel runs in float32 on CPU, not {name} on {device.type}"
        return None if k.cpu_kernels else "the C kernels are not built here (see nanokv doctor)"
    if kind == "flash":
        if device.type != "cuda":
            return "flash-attn runs on CUDA only"
        if not k.flash_attn:
            return "flash-attn is not installed"
        if dtype not in _HALF:
            return f"flash-attn computes in float16 or bfloat16, not {name}"
        if block_size % 256:
            return f"flash-attn's pages are a multiple of 256 tokens, not --block-size {block_size}"
        return None
    if kind == "triton":
        if not k.triton:
            return "triton is not installed (pip install triton)"
        if device.type == "cpu" and not k.triton_interpreter:
            return (
                "on CPU triton runs under its interpreter only: start the process with "
                "TRITON_INTERPRET=1"
            )
        if dtype not in (*_HALF, torch.float32):
            return f"the kernel computes in float16, bfloat16 or float32, not {name}"
    return None


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        # On CPU the kernels compute in float32 (as llama.cpp does), whatever the CPU offers:
        # a bfloat16 default would switch them off on AVX512-BF16 machines and run slower.
        return torch.float32
    resolved = _DTYPE_NAMES.get(str(dtype).lower())
    if resolved is None:
        raise ValueError(
            f"unknown dtype {dtype!r} (choose one of: auto, {', '.join(_DTYPE_NAMES)})"
        )
    return resolved


def resolve_device(device: str | None, rank: int = 0) -> torch.device:
    """The device a run uses: ``device`` (None: cuda if available, else cpu), checked to exist.

    A bare "cuda" is one GPU per tensor-parallel rank (``cuda:rank``). Raises ValueError
    saying which devices there are.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        message = f"--device {device!r} is not a device: use cpu, cuda or cuda:N"
        raise ValueError(message) from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ValueError(f"--device {device}: nanokv runs on cpu or cuda (cuda:N) only")
    if not torch.backends.cuda.is_built():
        raise ValueError(
            f"--device {device}: this torch build has no CUDA (it is the CPU build, "
            f"{torch.__version__}); use --device cpu"
        )
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ValueError(
            f"--device {device}: no CUDA device is visible (check the driver and "
            "CUDA_VISIBLE_DEVICES); use --device cpu"
        )
    if dev.index is None:
        dev = torch.device("cuda", rank)
    if dev.index >= count:
        which = f"{count} CUDA devices, cuda:0 to cuda:{count - 1}"
        which = which if count > 1 else "1 CUDA device, cuda:0"
        for_rank = f" for tensor-parallel rank {rank}" if device == "cuda" else ""
        raise ValueError(f"--device {dev}{for_rank}: this machine has {which}")
    return dev


def keep_freed_memory() -> bool:
    """Make glibc keep freed memory for reuse instead of returning it to the OS.

    Each decode step allocates and frees the same large buffers (logits, sampler temporaries,
    activations). By default glibc hands blocks over 32 MiB (and the heap's free top) back to
    the kernel, so the next step page-faults them in again - measured at ~100 ms for a 12 MiB
    tensor in a VM, against ~5 ms to compute on it. Pinning the thresholds keeps the memory in
    the heap, as a caching allocator would. Process-wide, Linux/glibc only; returns whether set.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        return bool(
            libc.mallopt(m_mmap_threshold, 1 << 30)
            and libc.mallopt(m_trim_threshold, (1 << 31) - 1)
        )
    except (OSError, AttributeError):  # not glibc (e.g. musl)
        return False
