"""Weight-only quantization of a built model for CPU inference (``--quantization int8|int4``).

At batch 1 a CPU decode step is bound by the bytes of weights it streams, so keeping them in 8
or 4 bits instead of 32 makes each step cheaper (``layers/quant.py`` has the formats,
``layers/cpu_kernels.c`` the kernels). ``quantize_model`` replaces a freshly built model's
linear projections, LM head and token embedding with ``QuantizedLinear`` modules in place, then
loads the remaining float parameters (norms); the float linear parameters the model was built
with were never written, so they are freed without having taken memory.

Modes:

- ``auto`` (the default): for a GGUF file, each projection and the LM head get a quantized
  twin made of the file's own blocks (``attach_file_blocks``), which serves steps of fewer
  than ``AUTO_MAX_ROWS`` rows, and copies laid out for tiled GEMMs for larger ones: a
  fixed-point copy (``layers.quant.FixedPointLinear``, 14-bit weights, error ~1e-4) for steps
  with prefill rows, and for decode steps int4 blocks unpacked into panels
  (``layers.quant.PanelInt4Linear``: the twin's arithmetic, ~1.3x faster; int8 layers use the
  fixed-point copy there too). The loaded float weights are then freed (a layer without the
  copies keeps its float path). Where the kernels cannot run (GPU, tensor parallelism, no C
  compiler) or the file has no blocks (safetensors), it is ``none``.
- ``int8``: projections, LM head and embedding table in int8 groups of 32 (Q8_0).
- ``int4``: projections in 4-bit groups of 32 (Q4_1); the LM head and embedding table in int8
  (a 4-bit head moves next-token distributions ~40x more than an int8 one, measured on the
  default model).

A GGUF file's own blocks are taken as they are wherever the format matches (Q8_0 in int8,
Q4_0/Q4_1 in int4, in either mode: requantizing a file's 4-bit weights to 8 bits only adds
error); every other tensor is quantized from its float values. A projection whose input size
is not a multiple of 32 stays in float32.

Batches of many rows (prefills, large decode batches) dequantize in chunks and run a float32
GEMM (``QuantizedLinear.dense_min_rows``) with no resident float copy. CPU only, one
tensor-parallel rank, and the C kernels must build (a C compiler).
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .layers import cpu_kernels
from .layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from .layers.linear import LinearBase
from .layers.quant import (
    GROUP_SIZE,
    FixedPointLinear,
    PanelInt4Linear,
    QuantizedEmbedding,
    QuantizedLinear,
)
from .loader import QuantizedTensor, load_gguf_quantized
from .models import load_weights

QUANTIZATION_CHOICES: tuple[str, ...] = ("auto", "none", "int8", "int4")
# ``auto``: steps of fewer rows than this run on the quantized twins, others on the
# batch copies or the float weights. SmolLM2, 2 threads, ms per decode step, twin / panels
# (contexts of 300): 2 rows 10.1 / 14.7, 4 rows 19.0 / 18.4, 6 rows 27.8 / 20.2, 8 rows
# 36.0 / 28.3, 16 rows 58.4 / 35.1; its Q8_0 LM head, twin / fixed point: 2 rows 2.49 /
# 2.52, 4 rows 4.29 / 2.62 ms (scripts/BENCHMARKS.md, change 23).
AUTO_MAX_ROWS = 4
HEAD_MODE = "int8"
# GGML types held exactly (gguf.GGMLQuantizationType Q4_0, Q4_1; Q8_0).
_EXACT_INT4_TYPES = frozenset({2, 3})
_EXACT_INT8_TYPES = frozenset({8})

Weight = torch.Tensor | QuantizedTensor


def parse_quantization(value: str | None) -> str | None:
    """The quantization mode for ``value``: None for no quantization ("none" or None)."""
    if value is None:
        return None
    mode = str(value).strip().lower()
    if mode not in QUANTIZATION_CHOICES:
        raise ValueError(
            f"unknown quantization {value!r} (choose one of: {', '.join(QUANTIZATION_CHOICES)})"
        )
    return None if mode == "none" else mode


def check_quantization(
    value: str | None, device: torch.device | str, tensor_parallel_size: int = 1
) -> str | None:
    """``parse_quantization``, refusing what the quantized kernels cannot run on.

    ``"auto"`` is never refused: where its kernels cannot run it means no quantization.
    """
    mode = parse_quantization(value)
    if mode == "auto":
        usable = (
            torch.device(device).type == "cpu"
            and tensor_parallel_size == 1
            and cpu_kernels.available()
        )
        return mode if usable else None
    if mode is None:
        return None
    if torch.device(device).type != "cpu":
        raise ValueError(
            f"quantization {mode!r} runs on the CPU only (its kernels are nanokv's C ones), "
            f"not on {device}: drop --quantization or use --device cpu"
        )
    if not cpu_kernels.available():
        raise ValueError(
            f"quantization {mode!r} needs nanokv's C kernels, which could not be built here "
            "(no C compiler found, or NANOKV_CPU_KERNELS=0)"
        )
    if tensor_parallel_size != 1:
        raise ValueError(
            f"quantization {mode!r} is not supported with tensor parallelism "
            f"(tensor_parallel_size={tensor_parallel_size}): quantized layers are not sharded"
        )
    return mode


def file_blocks(gguf_path: str) -> dict[str, QuantizedTensor]:
    """The GGUF file's weights whose blocks nanokv's kernels hold exactly (Q4_0, Q4_1, Q8_0)."""
    return {
        name: block
        for name, block in load_gguf_quantized(gguf_path).items()
        if _exact_mode(block) is not None
    }


def attach_file_blocks(model: nn.Module, blocks: Mapping[str, QuantizedTensor]) -> int:
    """``--quantization auto``: give the loaded float model's projections and LM head a
    quantized twin made of the file's own blocks, for steps of few rows, and copies for larger
    ones (fixed point; int4 blocks also in panels, for decode steps); returns how many layers
    got them.

    The float weights are the same blocks dequantized, so every path computes with the same
    weights; the twin only rounds its inputs to int8 per 32 values (as llama.cpp does). With
    both copies a layer never reads its float weight again, which is freed (a tied LM head's
    stays: it is the token embedding). A projection whose parts are not all exact blocks of
    one format keeps only its float path.
    """
    packed = _packed_parts(model)
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    attached = 0
    for path, module in model.named_modules():
        if isinstance(module, LinearBase):
            names = [f"{n}.weight" for n in _hf_names(path, packed)]
        elif isinstance(module, ParallelLMHead):
            names = ["model.embed_tokens.weight" if tied else f"{path}.weight"]
        else:
            continue
        modes = {_exact_mode(blocks[n]) if n in blocks else None for n in names}
        if len(modes) != 1 or None in modes:
            continue
        mode, parts = modes.pop(), [blocks[n] for n in names]
        bias = getattr(module, "bias", None)
        head = isinstance(module, ParallelLMHead) and mode == "int8"  # see float_inputs
        twin = QuantizedLinear.from_parts(parts, mode, bias, float_inputs=head)
        twin.dense_min_rows = AUTO_MAX_ROWS
        module.quantized = twin
        if module.weight.shape[1] % cpu_kernels.I16_BLOCK == 0:
            exact = FixedPointLinear(module.weight, bias)
            if mode == "int4":  # decode batches on the blocks' own arithmetic, prefills exact
                module.batched, module.exact = PanelInt4Linear(twin), exact
            else:
                module.batched = exact
            if not (tied and isinstance(module, ParallelLMHead)):
                # Empty, not deleted: its shape[1] still says the layer's input size.
                empty = module.weight.new_empty(0, module.weight.shape[1])
                module.weight = nn.Parameter(empty, requires_grad=False)
        attached += 1
    _release_freed_memory()
    return attached


def with_gguf_blocks(
    weights: Mapping[str, torch.Tensor], gguf_path: str, mode: str
) -> dict[str, Weight]:
    """``weights`` with the GGUF file's Q4_0/Q4_1/Q8_0 blocks in place of their float values.

    Those are taken exactly; every other conversion quantizes the dequantized values, which the
    float weights already are.
    """
    merged: dict[str, Weight] = dict(weights)
    if parse_quantization(mode) is not None:
        merged.update(file_blocks(gguf_path))
    return merged


def quantize_model(model: nn.Module, mode: str, weights: Mapping[str, Weight]) -> None:
    """Swap ``model``'s linear layers, LM head and embedding for quantized ones, load the rest.

    ``model`` is freshly built (its parameters not loaded yet); ``weights`` are Hugging Face
    named float tensors or GGUF blocks (``loader.QuantizedTensor``), as ``load_weights`` takes.
    Raises ValueError for an unknown mode, a missing weight or a shape that does not fit.
    """
    if parse_quantization(mode) is None:
        raise ValueError(f"quantize_model needs a quantization mode, got {mode!r}")
    packed = _packed_parts(model)
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, LinearBase)]
    for path, module in linears:
        if module.weight.shape[1] % GROUP_SIZE == 0:  # else it stays float (loaded below)
            _replace(model, path, _quantized_linear(path, module, mode, weights, packed))
    _quantize_vocab(model, weights)
    load_weights(model, weights)  # what is left: norms (and anything else not quantized)
    _release_freed_memory()


def resident_weight_bytes(model: nn.Module) -> int:
    """Bytes held by the model's weights: parameters and quantized or batch-copy buffers,
    shared ones once."""
    tensors: list[torch.Tensor] = list(model.parameters())
    for module in model.modules():
        if isinstance(module, (QuantizedLinear, FixedPointLinear, PanelInt4Linear)):
            tensors.extend(module.buffers(recurse=False))
    seen: dict[int, int] = {}
    for t in tensors:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


# -- building quantized modules -------------------------------------------------------------------


def _packed_parts(model: nn.Module) -> dict[str, list[str]]:
    """Fused module name -> the Hugging Face projections it stacks, in output order."""
    parts: dict[str, list[str]] = {}
    for hf_name, (ours, _) in getattr(model, "packed_modules_mapping", {}).items():
        parts.setdefault(ours, []).append(hf_name)  # the mapping lists parts in shard order
    return parts


def _hf_names(path: str, packed: dict[str, list[str]]) -> list[str]:
    """The Hugging Face module names a (possibly fused) module at ``path`` holds, in order."""
    parent, _, name = path.rpartition(".")
    prefix = f"{parent}." if parent else ""
    return [f"{prefix}{part}" for part in packed.get(name, [name])]


def _quantized_linear(
    path: str,
    module: LinearBase,
    mode: str,
    weights: Mapping[str, Weight],
    packed: dict[str, list[str]],
) -> QuantizedLinear:
    names = _hf_names(path, packed)
    parts = [_weight(weights, f"{n}.weight") for n in names]
    out_features, in_features = module.weight.shape
    shapes = [tuple(_shape(p)) for p in parts]
    if sum(s[0] for s in shapes) != out_features or any(s[1] != in_features for s in shapes):
        raise ValueError(
            f"model weights for {path}: expected [{out_features}, {in_features}] in total, "
            f"got {', '.join(str(list(s)) for s in shapes)}"
        )
    bias = None
    if module.bias is not None:
        bias = torch.cat([_weight(weights, f"{n}.bias").float() for n in names])
    if all(_exact_int4(p) for p in parts):
        mode = "int4"
    return QuantizedLinear.from_parts(parts, mode, bias)


def _quantize_vocab(model: nn.Module, weights: Mapping[str, Weight]) -> None:
    """The LM head and the embedding table; one shared quantized table when they are tied."""
    embeddings = [
        (n, m)
        for n, m in model.named_modules()
        if type(m) is VocabParallelEmbedding  # the LM head subclasses it
    ]
    heads = [(n, m) for n, m in model.named_modules() if isinstance(m, ParallelLMHead)]
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    dtype = next(iter(model.parameters())).dtype
    tables: dict[str, QuantizedLinear] = {}

    def table(name: str) -> QuantizedLinear:
        if name not in tables:
            part = _weight(weights, name)
            mode = _vocab_mode(part)
            # As the LM head, unrounded inputs (see QuantizedLinear.float_inputs).
            tables[name] = QuantizedLinear.from_parts([part], mode, float_inputs=mode == "int8")
        return tables[name]

    embed_names = {path: f"{path}.weight" for path, _ in embeddings}
    for path, _ in embeddings:
        _replace(model, path, _TypedEmbedding(table(embed_names[path]), dtype))
    for path, _ in heads:
        name = next(iter(embed_names.values())) if tied and embed_names else f"{path}.weight"
        _replace(model, path, table(name))


def _vocab_mode(part: Weight) -> str:
    return "int4" if _exact_int4(part) else HEAD_MODE


def _exact_int4(part: Weight) -> bool:
    return _exact_mode(part) == "int4"


def _exact_mode(part: Weight) -> str | None:
    """The mode that holds a GGUF block exactly (Q4_0/Q4_1: int4, Q8_0: int8), else None."""
    if not isinstance(part, QuantizedTensor):
        return None
    if part.qtype in _EXACT_INT4_TYPES:
        return "int4"
    return "int8" if part.qtype in _EXACT_INT8_TYPES else None


class _TypedEmbedding(QuantizedEmbedding):
    """Rows of a quantized table in the model's activation dtype."""

    def __init__(self, table: QuantizedLinear, dtype: torch.dtype) -> None:
        super().__init__(table)
        self.dtype = dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.table.embedding(input_ids)
        return rows if rows.dtype == self.dtype else rows.to(self.dtype)


def _weight(weights: Mapping[str, Weight], name: str) -> Any:
    if name not in weights:
        raise ValueError(f"model weights are missing tensor {name!r}")
    return weights[name]


def _shape(weight: Weight) -> tuple[int, ...]:
    return tuple(weight.shape)


def _replace(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, module)


def _release_freed_memory() -> None:
    """Hand the quantization's temporaries back to the OS (glibc keeps them otherwise)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
