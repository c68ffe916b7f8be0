"""``--quantization``: which of a model's layers the CPU weight formats hold, packed in place.

A CPU decode step is bound by the bytes of weights it reads, so the formats of ``formats.py``
keep weights in 4 or 8 bits and compute on them directly. Modes:

- ``auto`` (the default): every projection, LM head and embedding table whose GGUF blocks a
  format holds exactly (Q4_0, Q4_1, Q8_0) runs on those blocks as they are; anything else stays
  float. Where the kernels cannot run (GPU, tensor parallelism, no C compiler) or the model has
  no such blocks (safetensors), it is ``none``.
- ``int8``: every layer packed, Q8 from float values (a file's Q4 blocks stay Q4:
  requantizing 4-bit weights to 8 bits only adds error).
- ``int4``: projections in Q4 (Q4_1-style groups from float values); the LM head and
  embedding table in Q8 (a 4-bit head moves next-token distributions ~40x more than an 8-bit
  one, measured on the default model) unless the file already holds them in Q4.

Packing replaces a freshly built model's layer modules with ``PackedLinear`` before anything is
loaded; the float parameters they replace were never written, so they never took memory, and a
GGUF file's float copy is never made (the loader dequantizes lazily, only what stays float).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..cpu import kernels
from ..cpu.formats import (
    GROUP_SIZE,
    Q4,
    Q8,
    FloatLinear,
    PackedEmbedding,
    PackedLinear,
    WeightFormat,
    exact_format,
)
from ..layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from ..layers.linear import LinearBase
from ..models import load_weights
from ..runner.memory import release_freed_memory

QUANTIZATION_CHOICES: tuple[str, ...] = ("auto", "none", "int8", "int4")
# What each mode packs a layer into when the file's blocks do not decide it.
_PROJECTION_FORMAT = {"int8": Q8, "int4": Q4}
_VOCAB_FORMAT = Q8


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
    """``parse_quantization``, refusing what the CPU formats cannot run on.

    ``"auto"`` is never refused: where its kernels cannot run it means no quantization.
    """
    mode = parse_quantization(value)
    usable = (
        torch.device(device).type == "cpu" and tensor_parallel_size == 1 and kernels.available()
    )
    if mode == "auto" or mode is None:
        return mode if usable else None
    if torch.device(device).type != "cpu":
        raise ValueError(
            f"quantization {mode!r} runs on the CPU only (its kernels are nanokv's C ones), "
            f"not on {device}: drop --quantization or use --device cpu"
        )
    if not kernels.available():
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


def pack_model(
    model: nn.Module, mode: str, weights: Mapping[str, Any], blocks: Mapping[str, Any]
) -> int:
    """Pack ``model``'s layers as ``mode`` says, then load the rest of ``weights``.

    ``model`` is freshly built (nothing loaded); ``weights`` are Hugging Face named float
    tensors (read only for layers that stay float or are quantized from float), ``blocks`` the
    GGUF file's tensors by the same names (``loader.QuantizedTensor``; empty for safetensors).
    Returns how many layers were packed. Raises ValueError for a missing or misshapen weight.
    """
    packed = 0
    fused = _fused_parts(model)
    for path, module in list(model.named_modules()):
        if isinstance(module, LinearBase):
            names = _hf_names(path, fused)
            fmt = _format_for(mode, [blocks.get(f"{n}.weight") for n in names], _PROJECTION_FORMAT)
            if fmt is not None and module.weight.shape[1] % GROUP_SIZE == 0:
                _replace(model, path, _packed_linear(path, module, fmt, names, weights, blocks))
                packed += 1
    packed += _pack_vocab(model, mode, weights, blocks)
    load_weights(model, weights)  # what is left: norms and layers that stay float
    release_freed_memory()  # packing's temporaries
    return packed


def resident_weight_bytes(model: nn.Module) -> int:
    """Bytes held by the model's weights (parameters and packed buffers), shared ones once."""
    tensors: list[torch.Tensor] = list(model.parameters())
    for module in model.modules():
        if isinstance(module, PackedLinear):
            tensors.extend(module.buffers(recurse=False))
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(seen.values())


def _format_for(
    mode: str, parts: list[Any], fallback: Mapping[str, WeightFormat]
) -> WeightFormat | None:
    """The format a layer of these GGUF parts (None: not in the file) is packed into."""
    formats = {exact_format(p.qtype) if p is not None else None for p in parts}
    exact = formats.pop() if len(formats) == 1 else None
    if exact is not None and (mode == "auto" or exact is Q4):
        return exact  # the file's blocks, as they are
    return None if mode == "auto" else fallback.get(mode, _VOCAB_FORMAT)


def _packed_linear(
    path: str,
    module: LinearBase,
    fmt: WeightFormat,
    names: list[str],
    weights: Mapping[str, Any],
    blocks: Mapping[str, Any],
) -> PackedLinear:
    parts = [_part(f"{n}.weight", weights, blocks) for n in names]
    out_features, in_features = module.weight.shape
    shapes = [tuple(p.shape) for p in parts]
    if sum(s[0] for s in shapes) != out_features or any(s[1] != in_features for s in shapes):
        raise ValueError(
            f"model weights for {path}: expected [{out_features}, {in_features}] in total, "
            f"got {', '.join(str(list(s)) for s in shapes)}"
        )
    bias = None
    if module.bias is not None:
        bias = torch.cat([_part(f"{n}.bias", weights, {}).float() for n in names])
    return PackedLinear.from_parts(fmt, parts, bias)


def _pack_vocab(
    model: nn.Module, mode: str, weights: Mapping[str, Any], blocks: Mapping[str, Any]
) -> int:
    """The embedding table and LM head; one shared packed table when they are tied."""
    embeddings = [
        (n, m) for n, m in model.named_modules() if type(m) is VocabParallelEmbedding
    ]  # the LM head subclasses it
    heads = [(n, m) for n, m in model.named_modules() if isinstance(m, ParallelLMHead)]
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    dtype = next(iter(model.parameters())).dtype
    tables: dict[str, PackedLinear | None] = {}

    def table(name: str) -> PackedLinear | None:
        if name not in tables:
            fmt = _format_for(mode, [blocks.get(name)], {})
            tables[name] = (
                None
                if fmt is None
                else PackedLinear.from_parts(fmt, [_part(name, weights, blocks)])
            )
        return tables[name]

    embed_name = next((f"{path}.weight" for path, _ in embeddings), None)
    packed = 0
    for path, _ in heads:
        name = embed_name if tied and embed_name else f"{path}.weight"
        head = table(name)
        if head is not None:
            _replace(model, path, head)
            packed += 1
    for path, _ in embeddings:
        rows = table(f"{path}.weight")
        if rows is not None:
            _replace(model, path, PackedEmbedding(rows, dtype))
            packed += 1
    return packed


def _part(name: str, weights: Mapping[str, Any], blocks: Mapping[str, Any]) -> Any:
    if name in blocks:
        return blocks[name]
    if name not in weights:
        raise ValueError(f"model weights are missing tensor {name!r}")
    return weights[name]


def _fused_parts(model: nn.Module) -> dict[str, list[str]]:
    """Fused module name -> the Hugging Face projections it stacks, in output order."""
    parts: dict[str, list[str]] = {}
    for hf_name, (ours, _) in getattr(model, "packed_modules_mapping", {}).items():
        parts.setdefault(ours, []).append(hf_name)  # the mapping lists parts in shard order
    return parts


def _hf_names(path: str, fused: dict[str, list[str]]) -> list[str]:
    """The Hugging Face module names a (possibly fused) module at ``path`` holds, in order."""
    parent, _, name = path.rpartition(".")
    prefix = f"{parent}." if parent else ""
    return [f"{prefix}{part}" for part in fused.get(name, [name])]


def _replace(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, module)


def load_layers(
    model: nn.Module,
    weights: Mapping[str, Any],
    blocks: Mapping[str, Any],
    *,
    quantization: str | None,
    float_kernels: bool,
) -> None:
    """Give a freshly built model its weights, each layer in the format it runs in: packed as
    ``quantization`` says (None: float), and, with ``float_kernels``, float projections and
    LM head as ``FloatLinear`` - the C product for every row count, so a recorded decode step
    replays them and a row's bits do not depend on its batch (the CPU kernels, one rank,
    float32)."""
    if quantization is None:
        load_weights(model, weights)
    else:
        pack_model(model, quantization, weights, blocks)
    if not float_kernels:
        return
    for path, module in list(model.named_modules()):
        if isinstance(module, (LinearBase, ParallelLMHead)):
            bias = module.bias if isinstance(module, LinearBase) else None
            _replace(model, path, FloatLinear(module.weight, bias))
