"""The CPU backend's weight formats: one table entry per way a linear layer's weights are held.

A format says which GGUF block types it holds exactly (taken as they are, never requantized),
how its kernels round the input rows, and what it costs resident. Each has ONE packed layout
that serves every row count: the C kernels (``csrc/q4.c``, ``csrc/q8.c``) pick a few-row tile
for decode steps and a 6-row tile for batches and prefills over the same bytes, so nothing is
held twice and a row computes the same products whatever batch it is in.

- ``q4``: GGUF's Q4_0 and Q4_1 (``w = scale * q + zero``, q in 0..15 per 32 inputs), panels of
  16 outputs, two outputs' nibbles per byte (the file's own size). Inputs are rounded to int16
  per 32 values, every row of every step alike: so a token's K/V and logits are the same bits
  in a decode step, a prompt chunk or a recompute after preemption, and a prefix-cache hit
  (which changes what shares a step) cannot change a greedy answer. llama.cpp rounds them to
  int8 (its Q8_1 activations), which costs half the multiply-adds; int8 on prompt rows flipped
  the default model's answer to "What is the capital of France?", and int8 on decode rows only
  (what nanokv did before) let a row's bits depend on its step.
- ``q8``: GGUF's Q8_0 (``w = scale * q``, q in -127..127 per 32 inputs), panels of 16 outputs.
  Inputs are rounded to int16 per 32 values: this format serves the LM head, whose near ties
  between logits int8-rounded inputs flip (they turn the default model's answer to "What is
  the capital of France?" into nonsense), and 16-bit inputs cost little more.

Float weights of a layer no format holds stay torch tensors (``F.linear``). Quantizing float
weights into a format (``--quantization int8|int4``) rounds to nearest against float16 scales,
so a GGUF file's blocks and nanokv's own quantization are one representation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..model.gguf_file import byte_view, dequantize
from . import kernels

GROUP_SIZE = 32
# GGML type numbers (gguf.GGMLQuantizationType).
GGML_F32, GGML_F16, GGML_Q4_0, GGML_Q4_1, GGML_Q8_0, GGML_BF16 = 0, 1, 2, 3, 8, 30


class QuantizationError(ValueError):
    """A weight cannot be held in the format asked for (shape or GGUF type)."""


@dataclass(frozen=True)
class WeightFormat:
    name: str
    kind: int  # the C kernels' Linear kind
    gguf_types: frozenset[int]  # GGML types held exactly
    bytes_per_weight: float  # resident, scales included
    input_rounding: str  # what the kernels do to the input rows


Q4 = WeightFormat(
    "q4", kernels.LINEAR_Q4P, frozenset({GGML_Q4_0, GGML_Q4_1}), 0.625, "int16 per 32 values"
)
Q8 = WeightFormat("q8", kernels.LINEAR_Q8P, frozenset({GGML_Q8_0}), 1.0625, "int16 per 32 values")
FORMATS: dict[str, WeightFormat] = {f.name: f for f in (Q4, Q8)}


def exact_format(qtype: Any) -> WeightFormat | None:
    """The format that holds GGUF blocks of ``qtype`` exactly, or None."""
    kind = int(getattr(qtype, "value", qtype))
    return next((f for f in FORMATS.values() if kind in f.gguf_types), None)


@dataclass
class Groups:
    """Row-major quantized weights [N, K]: int8 q (q8) or GGUF-order nibbles [N, K/2] (q4);
    float16 scale (and zero, q4) [N, K/32]. What a GGUF file stores, before packing."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None = None


class PackedLinear(nn.Module):
    """``y = x W^T (+ b)`` with ``W`` packed in one format, for any number of rows; CPU only.

    Build with ``from_parts``: float weights or GGUF tensors (``loader.QuantizedTensor``)
    stacked along the outputs (a fused qkv or gate/up projection). ``embedding(ids)`` reads
    rows, so a tied embedding table and LM head share one packed copy.
    """

    def __init__(
        self,
        fmt: WeightFormat,
        weights: torch.Tensor,
        in_features: int,
        out_features: int,
        bias: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.format = fmt
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("packed", weights)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        self._sync_spec()

    @classmethod
    def from_parts(
        cls, fmt: WeightFormat, parts: Sequence[Any], bias: torch.Tensor | None = None
    ) -> PackedLinear:
        groups = [to_groups(part, fmt) for part in parts]
        widths = {g.scale.shape[1] * GROUP_SIZE for g in groups}
        if len(widths) != 1:
            raise QuantizationError(f"fused parts need one input size, got {sorted(widths)}")
        q = torch.cat([g.q for g in groups])
        scale = torch.cat([g.scale for g in groups])
        zero = torch.cat([g.zero for g in groups]) if fmt is Q4 else None
        return cls(fmt, kernels.pack(fmt.kind, q, scale, zero), widths.pop(), q.shape[0], bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.dtype != torch.float32 or rows.stride(-1) != 1:
            rows = rows.float().contiguous()
        y = kernels.linear(self.spec, rows)
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [out, in], exactly as the kernels see it."""
        return kernels.dequantize_rows(self.spec, torch.arange(self.out_features))

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Float32 rows ``W[ids]``, shape ``[*ids.shape, in_features]``."""
        flat = ids.reshape(-1).long().contiguous()
        return kernels.dequantize_rows(self.spec, flat).view(*ids.shape, self.in_features)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def _apply(self, fn: Any, recurse: bool = True) -> PackedLinear:
        # The spec holds raw pointers: rebuild it whenever the buffers may have moved, and
        # refuse a module-wide .to() the kernels cannot read.
        result = super()._apply(fn, recurse)
        self._sync_spec()
        return result

    def _sync_spec(self) -> None:
        if self.packed.device.type != "cpu" or (
            self.bias is not None and self.bias.dtype != torch.float32
        ):
            raise TypeError("packed layers stay on the CPU with a float32 bias")
        self.spec = kernels.linear_spec(
            self.format.kind,
            self.packed,
            self.in_features,
            bias=self.bias,
            out_features=self.out_features,
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"format={self.format.name}, bias={self.bias is not None}"
        )


class PackedEmbedding(nn.Module):
    """Token embedding read out of a (possibly shared) packed table, in the model's dtype."""

    def __init__(self, table: PackedLinear, dtype: torch.dtype) -> None:
        super().__init__()
        self.table = table
        self.dtype = dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.table.embedding(input_ids)
        return rows if rows.dtype == self.dtype else rows.to(self.dtype)


# -- into a format's groups ---------------------------------------------------------------------


def check_shape(rows: int, cols: int, fmt: WeightFormat) -> None:
    if cols % GROUP_SIZE:
        raise QuantizationError(
            f"{fmt.name} needs in_features % {GROUP_SIZE} == 0, got a [{rows}, {cols}] weight"
        )


def to_groups(part: Any, fmt: WeightFormat) -> Groups:
    """A float weight or a GGUF tensor as ``fmt``'s groups: GGUF blocks the format holds are
    taken bit for bit, anything else is quantized from its float values."""
    if isinstance(part, torch.Tensor):
        return quantize(part, fmt)
    rows, cols = (int(d) for d in part.shape)
    check_shape(rows, cols, fmt)
    kind = int(getattr(part.qtype, "value", part.qtype))
    if kind not in fmt.gguf_types:
        return quantize(dequantize(part), fmt)
    data = byte_view(part.data).reshape(rows, -1)
    if fmt is Q8:
        blocks = _block_fields(data, rows, cols, 34)
        q = blocks[..., 2:].contiguous().view(torch.int8).view(rows, cols)
        return Groups(q, _half(blocks, 0))
    blocks = _block_fields(data, rows, cols, 20 if kind == GGML_Q4_1 else 18)
    scale = _half(blocks, 0)
    zero = _half(blocks, 2) if kind == GGML_Q4_1 else scale * -8.0  # exact: a power of two
    nibbles = blocks[..., 4 if kind == GGML_Q4_1 else 2 :].reshape(rows, cols // 2)
    return Groups(nibbles.contiguous(), scale, zero)


def quantize(weight: torch.Tensor, fmt: WeightFormat) -> Groups:
    """Round a float weight [out, in] to nearest in ``fmt`` (float16 scales, as GGUF)."""
    if weight.dim() != 2:
        raise QuantizationError(f"expected a 2-D weight, got shape {tuple(weight.shape)}")
    check_shape(weight.shape[0], weight.shape[1], fmt)
    groups = weight.detach().float().view(weight.shape[0], -1, GROUP_SIZE)
    if fmt is Q8:  # symmetric (Q8_0)
        scale = (groups.abs().amax(dim=2) / 127.0).half()
        q = torch.round(groups * _inverse(scale)[..., None]).clamp_(-127, 127).to(torch.int8)
        return Groups(q.view(groups.shape[0], -1), scale)
    low, high = groups.amin(dim=2), groups.amax(dim=2)  # asymmetric min/max (Q4_1)
    scale, zero = ((high - low) / 15.0).half(), low.half()
    shifted = groups - zero.float()[..., None]
    q = torch.round(shifted * _inverse(scale)[..., None]).clamp_(0, 15).to(torch.uint8)
    nibbles = (q[..., :16] | (q[..., 16:] << 4)).reshape(q.shape[0], -1)  # GGUF's order
    return Groups(nibbles, scale, zero)


def _inverse(scale: torch.Tensor) -> torch.Tensor:
    scale = scale.float()
    return 1.0 / torch.where(scale > 0, scale, torch.ones_like(scale))


def _block_fields(data: torch.Tensor, rows: int, cols: int, block_bytes: int) -> torch.Tensor:
    if data.shape[1] != cols // GROUP_SIZE * block_bytes:
        raise QuantizationError(
            f"GGUF data of {data.shape[1]} bytes per row does not fit a [{rows}, {cols}] weight"
        )
    return data.view(rows, cols // GROUP_SIZE, block_bytes)


def _half(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    return blocks[..., offset : offset + 2].contiguous().view(torch.float16)[..., 0]


# -- float32 layers ----------------------------------------------------------------------------


class FloatLinear(nn.Module):
    """A float32 layer on the CPU, through the C kernels' ``LINEAR_F32`` for every row count
    (``csrc/linear.c``): one arithmetic per output, so a row's result does not depend on the
    rows it shares a batch with (torch's GEMM gives 1-3 rows other bits than more), and a
    recorded decode step can replay it at any size. ``weight`` stays shared (a tied LM head is
    the token embedding).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias
        self.spec = kernels.linear_spec(kernels.LINEAR_F32, weight, weight.shape[1], bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.weight.shape[1])
        if rows.dtype != torch.float32 or rows.stride(-1) != 1:
            rows = rows.float().contiguous()
        y = kernels.linear(self.spec, rows)
        return y.to(x.dtype).view(*x.shape[:-1], self.weight.shape[0])
