"""Weight-only quantization of a built model for CPU inference (``--quantization int8|int4``).

At batch 1 a CPU decode step is bound by the bytes of weights it streams, so keeping them in 8
or 4 bits instead of 32 makes each step cheaper (``layers/quant.py`` has the kernels and their
measurements). ``quantize_model`` replaces a freshly built model's linear projections, LM head
and token embedding with ``QuantizedLinear`` modules in place, then loads the remaining float
parameters (norms); the float linear parameters the model was built with were never written,
so they are freed without having taken memory.

Modes:

- ``int8``: projections, LM head and embedding table in per-channel int8.
- ``int4``: projections in 4-bit groups of 32 (asymmetric, as GGUF's Q4_1); the LM head and
  embedding table in int8 (a 4-bit head moves next-token distributions ~40x more than an int8
  one, measured on the default model).

From a GGUF file, Q4_0 and Q4_1 tensors become int4 layers exactly (``with_gguf_blocks``), in
either mode: those are the file's own weights, and requantizing them to per-channel int8 would
only add error (on the default model, next-token KL 7.7e-3 against 2.5e-3, and slower). Every
other tensor (Q8_0, K-quants, floats) is quantized from its float values.

A weight whose shape the int4 kernel cannot tile (``in_features % 32`` or ``out_features % 16``)
falls back to int8. Batches of many rows (prefills, large decode batches) dequantize in chunks
and run a float32 GEMM (``QuantizedLinear.dense_min_rows``) with no resident float copy; as that
dequantizes every weight each step, the linear layers cost 20-55% more than the float model's
at 32-128 rows (AVX2, scripts/profile_quant.py). Hence quantization serves single sequences and
small memory, and is off by default. CPU only, one tensor-parallel rank.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from .layers.linear import LinearBase
from .layers.quant import GROUP_SIZE, QuantizedEmbedding, QuantizedLinear
from .loader import QuantizedTensor, load_gguf_quantized
from .models import load_weights

QUANTIZATION_CHOICES: tuple[str, ...] = ("none", "int8", "int4")
HEAD_MODE = "int8"
# GGML types the int4 kernel's format holds exactly (gguf.GGMLQuantizationType Q4_0, Q4_1).
_EXACT_INT4_TYPES = frozenset({2, 3})

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
    """``parse_quantization``, refusing what the quantized kernels cannot run on."""
    mode = parse_quantization(value)
    if mode is None:
        return None
    if torch.device(device).type != "cpu":
        raise ValueError(
            f"quantization {mode!r} runs on the CPU only (its kernels are PyTorch's CPU "
            f"weight-only ones), not on {device}: drop --quantization or use --device cpu"
        )
    if tensor_parallel_size != 1:
        raise ValueError(
            f"quantization {mode!r} is not supported with tensor parallelism "
            f"(tensor_parallel_size={tensor_parallel_size}): quantized layers are not sharded"
        )
    return mode


def with_gguf_blocks(
    weights: Mapping[str, torch.Tensor], gguf_path: str, mode: str
) -> dict[str, Weight]:
    """``weights`` with the GGUF file's Q4_0/Q4_1 blocks in place of their float values.

    Those convert to int4 exactly; every other conversion requantizes the dequantized values,
    which the float weights already are.
    """
    merged: dict[str, Weight] = dict(weights)
    if parse_quantization(mode) is None:
        return merged
    for name, block in load_gguf_quantized(gguf_path).items():
        if _exact_int4(block):
            merged[name] = block
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
        _replace(model, path, _quantized_linear(path, module, mode, weights, packed))
    _quantize_vocab(model, weights)
    load_weights(model, weights)  # what is left: norms (and anything else not quantized)
    _release_freed_memory()


def resident_weight_bytes(model: nn.Module) -> int:
    """Bytes held by the model's weights: parameters and quantized buffers, shared ones once."""
    tensors: list[torch.Tensor] = list(model.parameters())
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
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


def _quantized_linear(
    path: str,
    module: LinearBase,
    mode: str,
    weights: Mapping[str, Weight],
    packed: dict[str, list[str]],
) -> QuantizedLinear:
    parent, _, name = path.rpartition(".")
    prefix = f"{parent}." if parent else ""
    names = [f"{prefix}{part}" for part in packed.get(name, [name])]
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
    return QuantizedLinear.from_parts(parts, _fitting_mode(mode, shapes), bias)


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
            tables[name] = QuantizedLinear.from_parts([part], _vocab_mode(part))
        return tables[name]

    embed_names = {path: f"{path}.weight" for path, _ in embeddings}
    for path, _ in embeddings:
        _replace(model, path, _TypedEmbedding(table(embed_names[path]), dtype))
    for path, _ in heads:
        name = next(iter(embed_names.values())) if tied and embed_names else f"{path}.weight"
        _replace(model, path, table(name))


def _vocab_mode(part: Weight) -> str:
    return _fitting_mode("int4", [part.shape]) if _exact_int4(part) else HEAD_MODE


def _exact_int4(part: Weight) -> bool:
    return isinstance(part, QuantizedTensor) and part.qtype in _EXACT_INT4_TYPES


def _fitting_mode(mode: str, shapes: list[tuple[int, ...]]) -> str:
    """``mode``, or int8 when the int4 kernel cannot tile one of the fused parts."""
    if mode == "int4" and any(rows % 16 or cols % GROUP_SIZE for rows, cols in shapes):
        return "int8"
    return mode


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
