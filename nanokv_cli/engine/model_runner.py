"""Runs the model for one scheduler step over the paged KV cache and samples the next tokens.

The runner owns the weights, the KV cache tensor (layout in ``layers/attention.py``:
``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``) and the sampler. Each step
it turns the scheduled sequences into one flat batch - token ids, positions, the slot mapping
that says where each new token's K/V goes, and per-step attention metadata - with a handful of
list and tensor operations per sequence (none per token), runs the model once, and computes
logits only at each sequence's last scheduled position.

On CPU in float32 the C kernels of ``cpu/`` serve (benchmark notes in
``scripts/BENCHMARKS.md``): paged decode attention, fused norms, rotary, K/V stores, silu * mul,
the packed weight formats of ``cpu/formats.py``, and the whole decoder in one call for decode
steps (the kernel calls of the torch layers, recorded on the largest decode step so far and
replayed). Each step gets a ``StepPlan`` saying which path it takes; float32 layers become
``FloatLinear`` (``_use_float_kernels``). Every path computes a row as the others do, to the bit:
a token's K/V and logits depend on the tokens before it, never on what shares its step (a
decode step, a prompt chunk cut anywhere, a recompute after preemption), so the prefix cache
cannot change a greedy answer (README, "A row computes the same bits whatever batch it is in").
"""

import ctypes
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .config import EngineConfig, ModelConfig
from .cpu import kernels as cpu_kernels
from .cpu.formats import FloatLinear
from .cpu.quantize import check_quantization, pack_model
from .layers.attention import (
    Attention,
    AttentionMetadata,
    DecodeGroup,
    FlashMetadata,
    PagedDecode,
    PrefillChunk,
    flash_attn_with_kvcache,
    uses_sdpa_prefill,
)
from .layers.embed_head import ParallelLMHead
from .layers.linear import LinearBase
from .layers.tp import tp_rank, tp_size
from .loader import QuantizedTensor
from .memory import InsufficientMemoryError, check_memory_fits, format_bytes, memory_limit
from .models import build_model, load_weights
from .sampler import Sampler
from .sequence import Sequence

# CPU KV cache budget when none is given: a quarter of the memory the process may still take
# at start-up (the tightest of ulimit -v, the cgroup limit and MemAvailable: memory_limit),
# within these bounds. 1 GiB held ~40 of the throughput benchmark's 64 sequences (SmolLM2,
# float32, block size 256), and the preemptions and smaller batches that followed cost 2x in
# throughput; 4 GiB holds all of them. Pages are only touched as blocks come into use.
DEFAULT_CPU_KV_CACHE_MEMORY = 1 << 30  # bytes, when available memory cannot be read
MIN_CPU_KV_CACHE_MEMORY = 256 << 20
MAX_CPU_KV_CACHE_MEMORY = 4 << 30

# Decode queries are split into at most this many length buckets of at least this many
# sequences: a bucket is padded to its own longest context, and each bucket costs one gather
# and one SDPA call per layer. Measured at batch 64 (SmolLM2 shapes, contexts 64..768): one
# bucket pads 45k rows for 28k real ones; eight pad 30k and run ~4x faster per layer.
MAX_DECODE_GROUPS = 8
MIN_DECODE_GROUP = 8

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


def default_cpu_kv_cache_memory() -> int:
    """Bytes for the CPU KV cache: a quarter of what the process may still take, clamped (see
    above), and never over half of it: under a tight ``ulimit -v`` or cgroup limit the
    minimum gives way rather than the allocation failing."""
    limit = memory_limit(torch.device("cpu"))
    if limit is None:
        return DEFAULT_CPU_KV_CACHE_MEMORY
    share = max(MIN_CPU_KV_CACHE_MEMORY, min(MAX_CPU_KV_CACHE_MEMORY, limit.free // 4))
    return max(0, min(share, limit.free // 2))


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


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class StepPlan:
    """How one step runs, chosen by the runner from what the step holds and passed down: no
    layer keeps a flag of its own."""

    # Single-token rows only, on the CPU kernels: the whole decoder in one C call (a recorded
    # step program, replayed), with the kernel calls, and so the bits, of the layers' path.
    # Precision is no part of a plan: every row's inputs are rounded as its layer's format
    # says, whatever else the step holds (cpu/formats.py).
    fused_decoder: bool


@dataclass
class StepBatch:
    """One step's model inputs, in the runner's order (single-token queries first)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    plan: StepPlan
    logits_rows: torch.Tensor | None  # rows of the hidden states to project; None: all
    restore: torch.Tensor | None  # permutation back to the caller's order; None: identity


class ModelRunner:
    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        engine_config: EngineConfig,
        *,
        quantized_blocks: Mapping[str, QuantizedTensor] | None = None,
    ) -> None:
        """``quantized_blocks``: a GGUF file's own blocks, for ``quantization="auto"``."""
        self.config = config
        self.engine_config = engine_config
        # Once, before any work: torch's pool and the C kernels (cpu/kernels.py reads
        # torch.get_num_threads()) run this many threads from here on.
        # Given threads win; by default never more than this process may run on, nor more
        # than the caller already set torch to (a benchmark's or a test's --threads 1).
        self.threads = engine_config.threads or min(
            torch.get_num_threads(), engine_config.thread_count()
        )
        torch.set_num_threads(self.threads)
        self.block_size = engine_config.block_size
        self.max_num_seqs = engine_config.max_num_seqs
        self.max_num_batched_tokens = engine_config.max_num_batched_tokens
        self.max_model_len = engine_config.model_len(config.max_position_embeddings)
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.device = self._resolve_device(engine_config.device)
        self.dtype = resolve_dtype(engine_config.dtype, self.device)
        self.quantization = check_quantization(
            engine_config.quantization, self.device, self.tp_size
        )
        # Before anything is allocated: what the model and the cache asked for imply.
        check_memory_fits(
            config, engine_config, self.device, self.dtype, self.quantization, self.tp_size
        )
        if self.device.type == "cpu":
            keep_freed_memory()
        with _default_dtype(self.dtype), self.device:
            self.model = build_model(config, max_position=self.max_model_len)
        if self.quantization is None:
            load_weights(self.model, weights)
        elif not pack_model(self.model, self.quantization, weights, quantized_blocks or {}):
            self.quantization = None  # "auto" on a file without blocks a format holds
        self.model.eval()
        # float32 on CPU: decodes read the cache in place through the C attention kernel, and
        # norms, rotary, K/V stores and silu*mul are fused C calls (cpu/kernels.py).
        self.use_cpu_kernel = (
            self.device.type == "cpu" and self.dtype == torch.float32 and cpu_kernels.available()
        )
        self.fused_decode = self.use_cpu_kernel and self.tp_size == 1
        # ``auto`` computes as llama.cpp does, and like llama.cpp keeps K/V in float16: a
        # batched decode step spends ~40% of its time reading float32 K/V (SmolLM2, 64
        # sequences of ~450 tokens), and the cache holds twice the tokens. Other modes keep
        # the model's dtype (``none`` stays float32 end to end, as transformers computes).
        self.kv_cache_dtype = (
            torch.float16
            if self.quantization == "auto"
            and self.use_cpu_kernel
            and cpu_kernels.half_cache_supported()
            else self.dtype
        )
        self._use_float_kernels()
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.sampler = Sampler()
        # flash-attn's paged kernels need pages of a multiple of 256 tokens and half precision.
        self.use_flash = (
            self.device.type == "cuda"
            and flash_attn_with_kvcache is not None
            and self.block_size % 256 == 0
            and self.dtype in (torch.float16, torch.bfloat16)
        )
        self.use_cuda_graph = self.use_flash and not engine_config.enforce_eager
        self._offsets = torch.arange(self.block_size)
        self._workspace: torch.Tensor | None = None
        self.num_blocks = self._resolve_num_blocks()
        self.kv_cache = self._allocate_kv_cache()
        # Decode steps replay the kernel calls recorded on the largest decode step so far (one
        # C call, cpu/kernels.py StepProgram): ~10 ms less Python per step for SmolLM2's 30
        # layers, and 12-18% faster than layer by layer at 17-64 rows (scripts/BENCHMARKS.md),
        # at any size: every layer format is a C product of any row count.
        self.fused_max_rows = float("inf") if self.fused_decode else 0
        self.program: cpu_kernels.StepProgram | None = None
        self._program_arena = torch.empty(0, dtype=torch.uint8)
        self._persistent = {
            t.untyped_storage().data_ptr()
            for t in [*self.model.parameters(), *self.model.buffers(), self.kv_cache]
            if t.layout == torch.strided  # not MKL's packed copies, which the kernels never see
        }
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if self.use_cuda_graph:
            self._capture_cuda_graphs()

    # -- set-up -------------------------------------------------------------------------------

    def _resolve_device(self, device: str | None) -> torch.device:
        dev = resolve_device(device, self.tp_rank)
        if dev.type == "cuda":  # pragma: no cover - GPU
            torch.cuda.set_device(dev)
        return dev

    def _use_float_kernels(self) -> None:
        """Float32 layers (projections and LM head) become ``FloatLinear`` where decode steps
        are recorded (the CPU kernels, one rank, float32): the C product for every row count,
        so a recorded step replays them and a row's bits do not depend on its batch."""
        if not self.fused_decode or self.dtype != torch.float32:
            return
        for path, module in list(self.model.named_modules()):
            if isinstance(module, (LinearBase, ParallelLMHead)):
                parent, _, name = path.rpartition(".")
                bias = module.bias if isinstance(module, LinearBase) else None
                setattr(self.model.get_submodule(parent), name, FloatLinear(module.weight, bias))

    @property
    def block_bytes(self) -> int:
        """Bytes of KV cache one block takes on this rank (all layers, K and V)."""
        layer = self.attention_layers[0]
        per_token = 2 * len(self.attention_layers) * layer.num_kv_heads * layer.head_dim
        return per_token * self.block_size * self.kv_cache_dtype.itemsize

    def _resolve_num_blocks(self) -> int:
        settings = self.engine_config
        if settings.num_blocks is not None:
            self._check_cache_fits(settings.num_blocks, "--num-blocks", str(settings.num_blocks))
            return settings.num_blocks
        memory = settings.kv_cache_memory
        if self.device.type == "cuda" and memory is None:  # pragma: no cover - GPU
            budget = self._gpu_kv_budget(settings.gpu_memory_utilization)
        else:
            budget = default_cpu_kv_cache_memory() if memory is None else memory
        if budget < self.block_bytes:
            if memory is not None:
                budget_is, fix = f"--kv-cache-memory {format_bytes(budget)}", "raise it"
            else:  # the default: a share of what the process may still take
                limit = memory_limit(self.device)
                budget_is = f"the default KV cache memory of {format_bytes(budget)}"
                fix = f"raise {limit.source}" if limit else "set --kv-cache-memory"
            raise InsufficientMemoryError(
                f"{budget_is} cannot hold a single block "
                f"({format_bytes(self.block_bytes)} for block size {self.block_size}): lower "
                f"--block-size or {fix}"
            )
        # More blocks than every admissible sequence at full length could never be used.
        ceiling = self.max_num_seqs * _cdiv(self.max_model_len, self.block_size)
        num_blocks = min(budget // self.block_bytes, ceiling)
        if memory is not None:
            self._check_cache_fits(num_blocks, "--kv-cache-memory", format_bytes(memory))
        return num_blocks

    def _check_cache_fits(self, num_blocks: int, flag: str, value: str) -> None:
        """A cache the user sized must fit in what the process may still take: the weights
        are in place by now, so the limit's headroom is what is left for it."""
        limit = memory_limit(self.device)
        size = num_blocks * self.block_bytes
        if limit is None or size <= limit.free:
            return
        raise InsufficientMemoryError(
            f"{flag} {value} asks for a {format_bytes(size)} KV cache ({num_blocks} blocks of "
            f"{format_bytes(self.block_bytes)}) but only {format_bytes(max(limit.free, 0))} "
            f"is free under {limit.source}: lower {flag} (or --block-size)"
        )

    def _gpu_kv_budget(self, utilization: float) -> int:  # pragma: no cover - GPU
        """Bytes left for the KV cache after weights and a worst-case prefill's activations."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        self._warmup()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        stats = torch.cuda.memory_stats()
        activations = stats["allocated_bytes.all.peak"] - stats["allocated_bytes.all.current"]
        # `total - free` covers weights, other processes and the CUDA context alike.
        return int(total * utilization - (total - free) - activations)

    def _warmup(self) -> None:  # pragma: no cover - GPU
        """Run the largest prefill a step may hold, before the cache exists, to size activations."""
        seq_len = min(self.max_model_len, self.max_num_batched_tokens)
        num_seqs = max(1, min(self.max_num_batched_tokens // seq_len, self.max_num_seqs))
        seqs = []
        for _ in range(num_seqs):
            seq = Sequence([0] * seq_len, block_size=self.block_size)
            seq.num_scheduled_tokens = seq_len
            seq.block_table = [0] * seq.num_blocks  # slots unused: no cache to write yet
            seqs.append(seq)
        self.run_logits(seqs)
        torch.cuda.synchronize()

    def commit_kv_cache(self) -> None:
        """Write every page of a CPU KV cache now, for a process that will keep it (a server).

        The cache is allocated uninitialised, so its pages are faulted in as blocks are first
        used, and the free queue hands out never-used blocks before reused ones: a server's RSS
        then climbs for as long as the cache has untouched blocks. Committed at start-up, the
        memory is all there from the first request, and a cache the machine cannot hold fails
        here, not under load. Huge pages where the kernel grants them (madvise): 4 GiB commits
        in ~0.5 s instead of 1.2-2.5 s of 4 KiB page faults here, and attention's reads need
        fewer TLB entries.
        """
        if self.kv_cache.device.type != "cpu":
            return
        advise_huge_pages(self.kv_cache)
        self.kv_cache.zero_()

    def _allocate_kv_cache(self) -> torch.Tensor:
        layer = self.attention_layers[0]
        # With CUDA graphs one extra block, never handed out, absorbs the K/V writes of padding
        # rows in a captured batch.
        blocks = self.num_blocks + (1 if self.use_cuda_graph else 0)
        # Left uninitialised (a 1 GiB torch.zeros costs ~1 s of page faults at start-up): no read
        # ever touches a slot before it is written - decode padding reads a written slot.
        shape = (len(self.attention_layers), 2, blocks, self.block_size)
        try:
            kv_cache = torch.empty(
                *shape,
                layer.num_kv_heads,
                layer.head_dim,
                dtype=self.kv_cache_dtype,
                device=self.device,
            )
        except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
            raise InsufficientMemoryError(
                f"could not allocate the {format_bytes(blocks * self.block_bytes)} KV cache "
                f"({blocks} blocks) on {self.device} ({str(e).splitlines()[0][:120]}): lower "
                "--num-blocks or --kv-cache-memory"
            ) from None
        for i, attn in enumerate(self.attention_layers):
            attn.k_cache = kv_cache[i, 0]
            attn.v_cache = kv_cache[i, 1]
        return kv_cache

    # -- per step -----------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, seqs: list[Sequence]) -> list[int]:
        """Compute each seq's scheduled tokens and sample one token per seq.

        Returns ``[]`` on tensor-parallel ranks other than 0 (only rank 0 samples).
        """
        logits = self.run_logits(seqs)
        return [] if logits is None else self.sampler(logits, seqs)

    @torch.inference_mode()
    def run_logits(self, seqs: list[Sequence]) -> torch.Tensor | None:
        """float32 logits [len(seqs), vocab] at each seq's last scheduled position."""
        if not seqs:
            raise ValueError("run needs at least one sequence")
        self.copy_kv(seqs)
        batch = self._prepare(seqs)
        hidden = self._forward(batch)
        if batch.logits_rows is not None:
            hidden = hidden.index_select(0, batch.logits_rows)
        logits = self.model.compute_logits(hidden)
        if logits is None:
            return None
        logits = logits.float()
        if batch.restore is not None:
            logits = logits.index_select(0, batch.restore)
        return logits

    def copy_kv(self, seqs: list[Sequence]) -> None:
        """Copy the K/V of each token-granular prefix hit (``Sequence.kv_copy``) into its
        sequence's block, in the order the block manager found them (a source a later copy
        overwrites is read first), before the step writes anything."""
        for s in seqs:
            if s.kv_copy is None:
                continue
            source, target, n = s.kv_copy
            s.kv_copy = None
            if source != target:  # a source taken as its own destination holds them already
                cache = self.kv_cache
                cache[:, :, target, :n].copy_(cache[:, :, source, :n])

    def forget(self, seq_id: int) -> None:
        """The request is finished: drop its sampler state."""
        self.sampler.forget(seq_id)

    def _forward(self, batch: StepBatch) -> torch.Tensor:
        if batch.plan.fused_decoder:
            return self._run_program(batch, self.model.model.embed_tokens(batch.input_ids))
        flash = batch.meta.flash
        if self.graphs and flash is not None and flash.decode_only:
            if len(batch.input_ids) <= self.graph_sizes[-1]:
                return self._replay(batch)  # pragma: no cover - GPU
        return self.model(batch.input_ids, batch.positions, batch.meta)

    def _run_program(self, batch: StepBatch, hidden: torch.Tensor) -> torch.Tensor:
        """A decode step: the step program, recorded from the torch forward on the first step
        with more rows than it has (that step runs as it is recorded), replayed otherwise."""
        meta, paged = batch.meta, batch.meta.paged_decode
        inputs = (hidden, batch.positions, meta.slot_mapping, paged.block_tables, paged.context_lens)
        rows, width = paged.block_tables.shape
        if self.program is None or rows > self.program.rows:
            with cpu_kernels.recording() as tape:
                out = self.model.model.decode(hidden, batch.positions, meta)
            self.program = cpu_kernels.StepProgram(tape, inputs, out, self._persistent)
            self._program_arena = torch.empty(self.program.arena_bytes, dtype=torch.uint8)
            return out
        return self.program.run(self._program_arena, inputs, rows, width)

    def _prepare(self, seqs: list[Sequence]) -> StepBatch:
        singles = [i for i, s in enumerate(seqs) if s.num_scheduled_tokens == 1]
        multis = [i for i, s in enumerate(seqs) if s.num_scheduled_tokens != 1]
        if not self.use_cpu_kernel:
            # Longest contexts first, so length buckets are contiguous runs of the batch.
            singles.sort(key=lambda i: seqs[i].num_cached_tokens, reverse=True)
        order = singles + multis
        ordered = [seqs[i] for i in order]
        num_singles = len(singles)
        bs = self.block_size

        token_ids: list[int] = []
        positions: list[int] = []
        decode_slots: list[int] = []
        for s in ordered[:num_singles]:
            pos = s.num_cached_tokens
            self._check_fits(s, pos + 1)
            token_ids.append(s.token_ids[pos])
            positions.append(pos)
            decode_slots.append(s.block_table[pos // bs] * bs + pos % bs)
        slot_parts = [torch.tensor(decode_slots, dtype=torch.long)]
        chunks: list[tuple[Sequence, int, torch.Tensor]] = []  # (seq, first row, context slots)
        rows = list(range(num_singles))
        start = num_singles
        for s in ordered[num_singles:]:
            cached, n = s.num_cached_tokens, s.num_scheduled_tokens
            if n < 1:
                raise ValueError(f"sequence {s.seq_id} has no scheduled tokens")
            self._check_fits(s, cached + n)
            token_ids += s.token_ids[cached : cached + n]
            positions += range(cached, cached + n)
            ctx_slots = self._context_slots(s.block_table, cached + n)
            slot_parts.append(ctx_slots[cached:])
            chunks.append((s, start, ctx_slots))
            start += n
            rows.append(start - 1)

        plan = StepPlan(fused_decoder=not chunks and len(ordered) <= self.fused_max_rows)
        meta = AttentionMetadata(slot_mapping=torch.cat(slot_parts))
        contexts = [s.num_cached_tokens + s.num_scheduled_tokens for s in ordered]
        if self.use_flash:  # pragma: no cover - GPU
            meta.flash = self._flash_metadata(ordered, contexts, num_singles)
        elif self.use_cpu_kernel:
            meta.paged_decode = self._paged_decode(ordered, contexts)
        else:
            meta.decode_groups = self._decode_groups(ordered[:num_singles], contexts)
            meta.prefills = [self._prefill_chunk(s, first, ctx) for s, first, ctx in chunks]
            meta.workspace = self._gather_workspace(meta)
        batch = StepBatch(
            input_ids=torch.tensor(token_ids, dtype=torch.long),
            positions=torch.tensor(positions, dtype=torch.long),
            meta=meta,
            plan=plan,
            logits_rows=torch.tensor(rows, dtype=torch.long) if multis else None,
            restore=None,
        )
        if order != sorted(order):
            restore = [0] * len(order)
            for row, i in enumerate(order):
                restore[i] = row
            batch.restore = torch.tensor(restore, dtype=torch.long)
        return self._to_device(batch)

    def _check_fits(self, seq: Sequence, context_len: int) -> None:
        if context_len > self.max_model_len:
            raise ValueError(
                f"sequence {seq.seq_id} reaches position {context_len - 1}, beyond "
                f"max_model_len={self.max_model_len}"
            )
        if len(seq.block_table) * self.block_size < context_len:
            raise ValueError(
                f"sequence {seq.seq_id} needs {_cdiv(context_len, self.block_size)} blocks for "
                f"{context_len} tokens but its block table has {len(seq.block_table)}"
            )

    def _context_slots(self, block_table: list[int], length: int) -> torch.Tensor:
        """Cache slots of positions 0..length-1 of a sequence."""
        table = torch.tensor(block_table[: _cdiv(length, self.block_size)], dtype=torch.long)
        return (table.unsqueeze(1) * self.block_size + self._offsets).view(-1)[:length]

    def _paged_decode(self, seqs: list[Sequence], contexts: list[int]) -> PagedDecode:
        """Every row of a CPU step for the C attention kernel, which reads K/V in place.

        A prefill chunk's row i is a query whose context ends at its own position: its K/V
        (and the rest of the chunk's) are stored before attention runs, so the kernel needs
        no gather of a cached prefix and no mask. Against the torch path's blockwise matmuls:
        1.2-2x faster for 128-1024-token prompts (scripts/BENCHMARKS.md, change 18).
        """
        lengths: list[int] = []
        owners: list[int] = []
        for i, (seq, context) in enumerate(zip(seqs, contexts)):
            n = seq.num_scheduled_tokens
            lengths += range(context - n + 1, context + 1)
            owners += [i] * n
        width = _cdiv(max(contexts), self.block_size)
        tables = torch.tensor([_padded(s.block_table, width) for s in seqs], dtype=torch.long)
        if len(owners) > len(seqs):
            tables = tables[torch.tensor(owners)]
        return PagedDecode(
            block_tables=tables, context_lens=torch.tensor(lengths, dtype=torch.long)
        )

    def _decode_groups(self, seqs: list[Sequence], contexts: list[int]) -> list[DecodeGroup]:
        if not seqs:
            return []
        num_groups = min(MAX_DECODE_GROUPS, max(1, len(seqs) // MIN_DECODE_GROUP))
        bounds = [round(len(seqs) * g / num_groups) for g in range(num_groups + 1)]
        groups = []
        for a, b in zip(bounds, bounds[1:]):
            max_len = contexts[a]  # sorted longest first
            num_blocks = _cdiv(max_len, self.block_size)
            table = torch.tensor(
                [_padded(s.block_table, num_blocks) for s in seqs[a:b]], dtype=torch.long
            )
            slots = (table.unsqueeze(2) * self.block_size + self._offsets).view(b - a, -1)
            lengths = torch.tensor(contexts[a:b])
            padding = torch.arange(max_len) >= lengths.unsqueeze(1)
            # Padding is masked out, but must still read finite numbers (0 * NaN is NaN): point
            # it at the sequence's first slot, which is always written.
            slots = torch.where(padding, slots[:, :1], slots[:, :max_len])
            bias = torch.zeros(b - a, max_len, dtype=self.dtype).masked_fill_(
                padding, float("-inf")
            )
            groups.append(
                DecodeGroup(
                    start=a, end=b, slots=slots.reshape(-1), bias=bias.view(b - a, 1, 1, max_len)
                )
            )
        return groups

    def _gather_workspace(self, meta: AttentionMetadata) -> torch.Tensor | None:
        """The reusable gather buffer, grown to this step's largest gather."""
        rows = max(
            [len(g.slots) for g in meta.decode_groups]
            + [len(c.ctx_slots) for c in meta.prefills if c.ctx_slots is not None],
            default=0,
        )
        if rows == 0:
            return None
        if self._workspace is None or self._workspace.shape[1] < rows:
            layer = self.attention_layers[0]
            grown = max(rows, 2 * self._workspace.shape[1] if self._workspace is not None else 0)
            shape = (2, grown, layer.num_kv_heads, layer.head_dim)
            self._workspace = torch.empty(shape, dtype=self.kv_cache_dtype, device=self.device)
        return self._workspace

    def _prefill_chunk(self, seq: Sequence, first: int, ctx_slots: torch.Tensor) -> PrefillChunk:
        cached, n = seq.num_cached_tokens, seq.num_scheduled_tokens
        chunk = PrefillChunk(start=first, end=first + n, num_cached=cached)
        if cached:
            chunk.ctx_slots = ctx_slots
        if cached and uses_sdpa_prefill(self.dtype):
            # Query i sits at position cached + i and sees keys 0..cached + i.
            chunk.mask = torch.arange(cached + n).unsqueeze(0) <= (
                torch.arange(cached, cached + n).unsqueeze(1)
            )
        return chunk

    def _flash_metadata(  # pragma: no cover - GPU
        self, seqs: list[Sequence], contexts: list[int], num_singles: int
    ) -> FlashMetadata:
        q_lens = [s.num_scheduled_tokens for s in seqs]
        width = _cdiv(max(contexts), self.block_size)
        decode_only = num_singles == len(seqs)
        tables = None
        if decode_only or any(c > q for c, q in zip(contexts, q_lens)):
            tables = torch.tensor([_padded(s.block_table, width) for s in seqs], dtype=torch.int32)
        if decode_only:
            return FlashMetadata(
                decode_only=True,
                context_lens=torch.tensor(contexts, dtype=torch.int32),
                block_tables=tables,
            )
        return FlashMetadata(
            decode_only=False,
            block_tables=tables,
            cu_seqlens_q=_cumsum0(q_lens),
            cu_seqlens_k=_cumsum0(contexts),
            max_seqlen_q=max(q_lens),
            max_seqlen_k=max(contexts),
        )

    def _to_device(self, batch: StepBatch) -> StepBatch:
        if self.device.type == "cpu":
            return batch

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(self.device, non_blocking=True)

        meta = batch.meta
        meta.slot_mapping = move(meta.slot_mapping)
        for g in meta.decode_groups:
            g.slots, g.bias = move(g.slots), move(g.bias)
        for c in meta.prefills:
            c.ctx_slots, c.mask = move(c.ctx_slots), move(c.mask)
        if meta.flash is not None:
            f = meta.flash
            f.context_lens, f.block_tables = move(f.context_lens), move(f.block_tables)
            f.cu_seqlens_q, f.cu_seqlens_k = move(f.cu_seqlens_q), move(f.cu_seqlens_k)
        batch.input_ids, batch.positions = move(batch.input_ids), move(batch.positions)
        batch.logits_rows, batch.restore = move(batch.logits_rows), move(batch.restore)
        return batch

    # -- CUDA graphs (decode) -----------------------------------------------------------------

    def _capture_cuda_graphs(self) -> None:  # pragma: no cover - GPU
        """Capture the decode forward for a ladder of batch sizes (as nano-vllm does)."""
        max_bs = min(self.max_num_seqs, 512)
        width = _cdiv(self.max_model_len, self.block_size)
        scratch_slot = self.num_blocks * self.block_size
        dev = self.device
        self._graph_inputs = {
            "input_ids": torch.zeros(max_bs, dtype=torch.long, device=dev),
            "positions": torch.zeros(max_bs, dtype=torch.long, device=dev),
            "slot_mapping": torch.full((max_bs,), scratch_slot, dtype=torch.long, device=dev),
            "context_lens": torch.zeros(max_bs, dtype=torch.int32, device=dev),
            "block_tables": torch.zeros(max_bs, width, dtype=torch.int32, device=dev),
            "outputs": torch.zeros(max_bs, self.config.hidden_size, dtype=self.dtype, device=dev),
        }
        ladder = {1, 2, 4, 8, *range(16, max_bs + 1, 16), max_bs}
        self.graph_sizes = sorted(b for b in ladder if b <= max_bs)
        g = self._graph_inputs
        pool = None
        with torch.inference_mode():
            for b in reversed(self.graph_sizes):
                meta = self._graph_meta(b)
                g["outputs"][:b] = self.model(g["input_ids"][:b], g["positions"][:b], meta)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool):
                    g["outputs"][:b] = self.model(g["input_ids"][:b], g["positions"][:b], meta)
                if pool is None:
                    pool = graph.pool()
                self.graphs[b] = graph
                torch.cuda.synchronize()

    def _graph_meta(self, b: int) -> AttentionMetadata:  # pragma: no cover - GPU
        g = self._graph_inputs
        return AttentionMetadata(
            slot_mapping=g["slot_mapping"][:b],
            flash=FlashMetadata(
                decode_only=True,
                context_lens=g["context_lens"][:b],
                block_tables=g["block_tables"][:b],
            ),
        )

    def _replay(self, batch: StepBatch) -> torch.Tensor:  # pragma: no cover - GPU
        n = len(batch.input_ids)
        b = next(size for size in self.graph_sizes if size >= n)
        g = self._graph_inputs
        flash = batch.meta.flash
        g["input_ids"][:n] = batch.input_ids
        g["positions"][:n] = batch.positions
        g["slot_mapping"].fill_(self.num_blocks * self.block_size)
        g["slot_mapping"][:n] = batch.meta.slot_mapping
        g["context_lens"].zero_()
        g["context_lens"][:n] = flash.context_lens
        if flash.block_tables is not None:
            g["block_tables"][:n, : flash.block_tables.shape[1]] = flash.block_tables
        self.graphs[b].replay()
        return g["outputs"][:n]


def _padded(table: list[int], width: int) -> list[int]:
    row = table[:width]
    return row + [0] * (width - len(row))


def _cumsum0(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
