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
replayed). What runs where is the ``RunPlan`` the runner is built from (``run_plan.py``); the
attention back end describes each step for its layers (``attention_backends.py``), and each
step gets a ``StepPlan`` saying which path it takes. Every path computes a row as the others do, to the bit:
a token's K/V and logits depend on the tokens before it, never on what shares its step (a
decode step, a prompt chunk cut anywhere, a recompute after preemption), so the prefix cache
cannot change a greedy answer (README, "A row computes the same bits whatever batch it is in").
"""

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed

from ..config import ModelConfig
from ..cpu import program as cpu_program
from ..layers.attention import Attention, AttentionMetadata
from ..model.loader import QuantizedTensor
from ..model.quantize import load_layers
from ..models import build_model
from ..sequence import Sequence
from ..tiers.model_tier import ModelTier
from .attention_backends import backend_for
from .cuda_graphs import DecodeGraphs
from .kv_cache import (
    CacheShape,
    allocate,
    check_memory_fits,
    commit,
    count_blocks,
    needs_gpu_budget,
)
from .run_plan import RunPlan, apply_process_settings
from .sampler import Sampler


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _smallest(count: int, group: Any) -> int:
    counts = torch.tensor([count])
    torch.distributed.all_reduce(counts, op=torch.distributed.ReduceOp.MIN, group=group)
    return int(counts)


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
    # Single-token rows only: on CUDA, a captured decode graph may replay the step.
    decode_only: bool = False


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
    """One rank's model, KV cache and sampler, built from a ``RunPlan``."""

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        plan: RunPlan,
        *,
        quantized_blocks: Mapping[str, QuantizedTensor] | None = None,
        cache_group: Any = None,
    ) -> None:
        """``plan``: how to run, everything the settings decide (``resolve_plan``).
        ``quantized_blocks``: a GGUF file's own blocks, for ``quantization="auto"``.
        ``cache_group``: a tensor-parallel run's process group, whose ranks all take the
        smallest block count any of them can hold (rank 0's block manager hands out block
        ids for every rank at once)."""
        self.config, self.plan = config, plan
        apply_process_settings(plan)
        # Before anything is allocated: what the model and the cache asked for imply.
        check_memory_fits(config, plan)
        with _default_dtype(plan.dtype), plan.device:
            self.model = build_model(config, max_position=plan.max_model_len)
        load_layers(
            self.model,
            weights,
            quantized_blocks or {},
            quantization=plan.quantization,
            float_kernels=plan.float_kernels,
        )
        self.model.eval()
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        layer = self.attention_layers[0]
        self.backend = backend_for(plan, layer.num_kv_heads, layer.head_dim, layer.group)
        self.sampler = Sampler()
        self.cache_shape = CacheShape(
            len(self.attention_layers),
            layer.num_kv_heads,
            layer.head_dim,
            plan.block_size,
            plan.kv_cache_dtype,
            plan.device,
        )
        # Everything a step reads besides the cache is in place before the memory-sizing
        # warm-up runs one (issue 44: CUDA runs without a cache size crashed here).
        self._offsets = torch.arange(plan.block_size)
        self.graphs: DecodeGraphs | None = None
        # The second tier's backend (kv_tier; tiers/model_tier.py), attached by whoever opens
        # it once the cache exists: restores land in the cache before each forward pass.
        self.tier: ModelTier | None = None
        gpu_budget = None
        if needs_gpu_budget(self.cache_shape, plan):
            gpu_budget = self._gpu_kv_budget(plan.gpu_memory_utilization)
        size = count_blocks(self.cache_shape, plan, gpu_budget)
        self.num_blocks = size.num_blocks
        # What decided the size, for the line commands print at start-up.
        self.kv_cache_source = size.source
        if cache_group is not None:
            self.num_blocks = _smallest(size.num_blocks, cache_group)
            if self.num_blocks < size.num_blocks:
                self.kv_cache_source = "the smallest rank's cache"
        # With CUDA graphs one extra block, never handed out, absorbs the K/V writes of padding
        # rows in a captured batch.
        self.kv_cache = allocate(self.cache_shape, self.num_blocks + plan.cuda_graphs)
        for i, attn in enumerate(self.attention_layers):
            attn.k_cache, attn.v_cache = self.kv_cache[i, 0], self.kv_cache[i, 1]
        # Decode steps replay the kernel calls recorded on the largest decode step so far (one
        # C call, cpu/kernels.py StepProgram): ~10 ms less Python per step for SmolLM2's 30
        # layers, and 12-18% faster than layer by layer at 17-64 rows (scripts/BENCHMARKS.md),
        # at any size: every layer format is a C product of any row count.
        self.program: cpu_program.StepProgram | None = None
        self._program_arena = torch.empty(0, dtype=torch.uint8)
        self._persistent = {
            t.untyped_storage().data_ptr()
            for t in [*self.model.parameters(), *self.model.buffers(), self.kv_cache]
            if t.layout == torch.strided  # not MKL's packed copies, which the kernels never see
        }
        self.graphs = self._capture_cuda_graphs() if plan.cuda_graphs else None

    # What the plan decided, under the names callers read.
    device = property(lambda self: self.plan.device)
    dtype = property(lambda self: self.plan.dtype)
    kv_cache_dtype = property(lambda self: self.plan.kv_cache_dtype)
    quantization = property(lambda self: self.plan.quantization)
    threads = property(lambda self: self.plan.threads)
    block_size = property(lambda self: self.plan.block_size)
    max_model_len = property(lambda self: self.plan.max_model_len)

    @property
    def block_bytes(self) -> int:
        """Bytes of KV cache one block takes on this rank (all layers, K and V)."""
        return self.cache_shape.block_bytes

    # -- set-up -------------------------------------------------------------------------------

    def _gpu_kv_budget(self, utilization: float) -> int:
        """Bytes left for the KV cache after weights and a worst-case prefill's activations
        (CUDA; a test runs it on CPU with torch.cuda's memory figures stood in)."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        self._warmup()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        stats = torch.cuda.memory_stats()
        activations = stats["allocated_bytes.all.peak"] - stats["allocated_bytes.all.current"]
        # `total - free` covers weights, other processes and the CUDA context alike.
        return int(total * utilization - (total - free) - activations)

    def _warmup(self) -> None:
        """Run the largest prefill a step may hold, before the cache exists, to size activations.

        Every row maps to block 0, so a one-block cache (zeroed: attention reads it) serves
        the warm-up: back ends that read K/V in place from the cache (Triton) run as in a step.
        """
        plan = self.plan
        scratch = allocate(self.cache_shape, 1).zero_()
        for i, attn in enumerate(self.attention_layers):
            attn.k_cache, attn.v_cache = scratch[i, 0], scratch[i, 1]
        seq_len = min(plan.max_model_len, plan.max_num_batched_tokens)
        num_seqs = max(1, min(plan.max_num_batched_tokens // seq_len, plan.max_num_seqs))
        seqs = []
        for _ in range(num_seqs):
            seq = Sequence([0] * seq_len, block_size=plan.block_size)
            seq.num_scheduled_tokens = seq_len
            seq.block_table = [0] * seq.num_blocks  # every slot in the scratch block
            seqs.append(seq)
        self.run_logits(seqs)
        if plan.device.type == "cuda":
            torch.cuda.synchronize()

    def _capture_cuda_graphs(self) -> DecodeGraphs:  # pragma: no cover - GPU
        return self._decode_graphs().capture(self.model)

    def _decode_graphs(self) -> DecodeGraphs:
        """The static inputs of the decode graphs, before capture (a CPU test stages steps
        into them)."""
        plan = self.plan
        return DecodeGraphs(
            attention=plan.attention,
            max_num_seqs=plan.max_num_seqs,
            width=_cdiv(plan.max_model_len, plan.block_size),
            scratch_slot=self.num_blocks * plan.block_size,
            hidden_size=self.config.hidden_size,
            dtype=plan.dtype,
            device=plan.device,
            kv_heads=self.cache_shape.num_kv_heads,
            max_context=plan.max_model_len,
        )

    def commit_kv_cache(self) -> None:
        """Write every page of the KV cache now, for a process that will keep it (a server):
        ``kv_cache.commit``."""
        commit(self.kv_cache)

    # -- per step -----------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, seqs: list[Sequence]) -> list[int]:
        """Compute each seq's scheduled tokens and sample one token per seq.

        Returns ``[]`` on tensor-parallel ranks other than 0 (only rank 0 samples).
        """
        if self.tier is None:
            logits = self.run_logits(seqs)
            return [] if logits is None else self.sampler(logits, seqs)
        # Timed to the sampled ints (a CUDA step has finished then): the prefill speed the
        # tier weighs restores against.
        started = time.perf_counter()
        tokens = sum(s.num_scheduled_tokens for s in seqs)
        logits = self.run_logits(seqs)
        sampled = [] if logits is None else self.sampler(logits, seqs)
        self.tier.observe(tokens, time.perf_counter() - started, self.block_size)
        return sampled

    @torch.inference_mode()
    def run_logits(self, seqs: list[Sequence]) -> torch.Tensor | None:
        """float32 logits [len(seqs), vocab] at each seq's last scheduled position."""
        if not seqs:
            raise ValueError("run needs at least one sequence")
        self.copy_kv(seqs)
        if self.tier is not None:
            self.tier.apply()  # after the copies: a copy's source may be a restore's target
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
        if self.graphs and batch.plan.decode_only:  # pragma: no cover - GPU
            if self.graphs.covers(len(batch.input_ids)):
                return self.graphs.replay(batch.input_ids, batch.positions, batch.meta)
        return self.model(batch.input_ids, batch.positions, batch.meta)

    def _run_program(self, batch: StepBatch, hidden: torch.Tensor) -> torch.Tensor:
        """A decode step: the step program, recorded from the torch forward on the first step
        with more rows than it has (that step runs as it is recorded), replayed otherwise."""
        meta, paged = batch.meta, batch.meta.paged_decode
        inputs = (
            hidden,
            batch.positions,
            meta.slot_mapping,
            paged.block_tables,
            paged.context_lens,
        )
        rows, width = paged.block_tables.shape
        if self.program is None or rows > self.program.rows:
            with cpu_program.recording() as tape:
                out = self.model.model.decode(hidden, batch.positions, meta)
            self.program = cpu_program.StepProgram(tape, inputs, out, self._persistent)
            self._program_arena = torch.empty(self.program.arena_bytes, dtype=torch.uint8)
            return out
        return self.program.run(self._program_arena, inputs, rows, width)

    def _prepare(self, seqs: list[Sequence]) -> StepBatch:
        singles = [i for i, s in enumerate(seqs) if s.num_scheduled_tokens == 1]
        multis = [i for i, s in enumerate(seqs) if s.num_scheduled_tokens != 1]
        if self.backend.sorts_decodes:
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

        plan = StepPlan(
            fused_decoder=self.plan.fused_decoder and not chunks, decode_only=not chunks
        )
        meta = AttentionMetadata(slot_mapping=torch.cat(slot_parts))
        contexts = [s.num_cached_tokens + s.num_scheduled_tokens for s in ordered]
        self.backend.describe(meta, ordered, contexts, num_singles, chunks)
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
        if meta.triton is not None:
            meta.triton = meta.triton.to(self.device)
        batch.input_ids, batch.positions = move(batch.input_ids), move(batch.positions)
        batch.logits_rows, batch.restore = move(batch.logits_rows), move(batch.restore)
        return batch
