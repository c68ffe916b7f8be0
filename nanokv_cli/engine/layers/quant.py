"""Weight-only quantized linear layers for CPU, run by nanokv's C kernels (``cpu_kernels.c``).

At batch 1 a CPU decode step is bound by the bytes of weights it reads, so keeping weights in
8 or 4 bits beats a dense matmul. Both formats are GGUF's own, so a GGUF file's blocks are taken
as they are:

- ``int8``: symmetric groups of 32 along the input, ``w = scale * q``, q in -127..127 with a
  float16 scale per group: GGUF's Q8_0. 1.06 bytes per weight.
- ``int4``: asymmetric groups of 32, ``w = scale * q + zero``, q in 0..15 with float16 scale
  and zero per group, nibbles in GGUF's order (byte j of a group holds elements j and j + 16):
  Q4_1 exactly, and Q4_0 with ``zero = -8 * scale``. 0.625 bytes per weight.

The kernels quantize each input row to int8 per group of 32 (as llama.cpp does) and sum
integer products, 32 per AVX2 instruction; that rounding is the only error they add to a
float32 matmul with the dequantized weight (~0.5% of the output's norm for Gaussian inputs).
Inputs of ``dense_min_rows`` rows or more (prefills, large decode batches) run as a float32
GEMM over weights dequantized in row chunks, so no dense copy stays resident.

Measured with scripts/profile_quant.py and scripts/bench_decode.py: see scripts/BENCHMARKS.md.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from . import cpu_kernels

QuantMode = Literal["int8", "int4"]
MODES: tuple[str, ...] = ("int8", "int4")
GROUP_SIZE = 32
# Rows (tokens) from which dequantizing to float32 and running a dense GEMM beats the
# quantized kernel, whose cost grows with every row. Measured on SmolLM2's 30 layers (AVX2,
# 1 thread, ms per step, kernel / dequantize + GEMM): int8 at 12 rows 65 / 72, at 16 86 / 87;
# int4 at 24 rows 130 / 152, at 32 172 / 169 (its 4-bit dequantization costs more).
DENSE_MIN_ROWS: dict[str, int] = {"int8": 16, "int4": 32}
# Elements dequantized at a time on the dense path: 4 MB of float32 stays in cache for the GEMM.
_DENSE_CHUNK_ELEMENTS = 1 << 20
# GGML type numbers (gguf.GGMLQuantizationType) decoded here without a float round trip.
_F32, _F16, _Q4_0, _Q4_1, _Q8_0, _BF16 = 0, 1, 2, 3, 8, 30
_KIND = {"int8": cpu_kernels.LINEAR_Q8, "int4": cpu_kernels.LINEAR_Q4}


class QuantizationError(ValueError):
    """A weight cannot be quantized as asked (shape, mode or GGUF type)."""


@dataclass
class _Groups:
    """Quantized rows: int8 q [N, K] or packed nibbles uint8 [N, K/2]; float16 scale (and
    zero for int4) [N, K/32]."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None


class _KernelLinear(nn.Module):
    """A linear layer the C kernels run from ``self.spec``, a view of its buffers made by
    ``_sync_spec`` (raw pointers: rebuilt whenever the buffers may have moved)."""

    spec: cpu_kernels.LinearSpec

    def _sync_spec(self) -> None:
        raise NotImplementedError

    def _apply(self, fn: Any, recurse: bool = True) -> _KernelLinear:
        result = super()._apply(fn, recurse)
        self._sync_spec()
        return result

    @property
    def nbytes(self) -> int:
        """Resident bytes of the weight, its scales (and zeros) and the bias."""
        return sum(b.numel() * b.element_size() for b in self.buffers())


class QuantizedLinear(_KernelLinear):
    """``y = x W^T (+ b)`` with ``W`` held in int8 or int4 groups; CPU only.

    Build with ``from_float`` (quantize a float weight), ``from_gguf`` (take GGUF blocks) or
    ``from_parts`` (a fused projection). ``forward`` takes ``[..., in_features]`` in any float
    dtype and returns the same dtype. ``embedding(ids)`` gathers dequantized rows, so a tied
    embedding table and LM head share one quantized copy.
    """

    def __init__(
        self,
        mode: QuantMode,
        in_features: int,
        qweight: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        float_inputs: bool = False,
    ) -> None:
        super().__init__()
        if mode not in MODES:
            raise QuantizationError(f"unknown quantization mode {mode!r} (choose from {MODES})")
        if not cpu_kernels.available():
            raise QuantizationError(
                "quantized layers run on nanokv's C kernels, which could not be built here "
                "(no C compiler, or NANOKV_CPU_KERNELS=0)"
            )
        if float_inputs and mode != "int8":
            raise QuantizationError("float_inputs needs int8 weights")
        self.mode = mode
        # int8 only: multiply the float inputs as they are, without rounding them to int8 (for
        # an LM head, whose near ties that rounding can flip; see cpu_kernels.c).
        self.float_inputs = float_inputs
        self.in_features = in_features
        self.out_features = qweight.shape[0]
        self.dense_min_rows: float = DENSE_MIN_ROWS[mode]
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("scale", scale.contiguous())
        self.register_buffer("zero", None if zero is None else zero.contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        self._sync_spec()

    # -- construction -----------------------------------------------------------------------

    @classmethod
    def from_float(
        cls, weight: torch.Tensor, mode: QuantMode, bias: torch.Tensor | None = None
    ) -> QuantizedLinear:
        """Quantize a float weight ``[out_features, in_features]`` (round to nearest)."""
        return cls._build(mode, [_quantize(weight, mode)], bias)

    @classmethod
    def from_gguf(
        cls,
        raw: np.ndarray | torch.Tensor,
        qtype: Any,
        shape: Sequence[int],
        mode: QuantMode,
        bias: torch.Tensor | None = None,
    ) -> QuantizedLinear:
        """Take a GGUF tensor's raw blocks (``shape`` = (out, in), torch order).

        Exact where the formats match: Q8_0 to ``int8``, Q4_0 and Q4_1 to ``int4``. Any other
        pair quantizes the dequantized weight.
        """
        return cls._build(mode, [_convert_gguf(raw, qtype, shape, mode)], bias)

    @classmethod
    def from_parts(
        cls,
        parts: Sequence[Any],
        mode: QuantMode,
        bias: torch.Tensor | None = None,
        float_inputs: bool = False,
    ) -> QuantizedLinear:
        """A fused projection (qkv, gate/up): ``parts`` stacked along the output dimension.

        Each part is a float weight or a GGUF tensor (``loader.QuantizedTensor``: ``data``,
        ``qtype``, ``shape``); mixed GGUF types are fine. Quantization works per row, so fusing
        first or after gives the same weights.
        """
        groups = [
            _quantize(part, mode)
            if isinstance(part, torch.Tensor)
            else _convert_gguf(part.data, part.qtype, part.shape, mode)
            for part in parts
        ]
        return cls._build(mode, groups, bias, float_inputs)

    @classmethod
    def _build(
        cls,
        mode: QuantMode,
        parts: Sequence[_Groups],
        bias: torch.Tensor | None,
        float_inputs: bool = False,
    ) -> QuantizedLinear:
        widths = {part.scale.shape[1] * GROUP_SIZE for part in parts}
        if len(widths) != 1:
            raise QuantizationError(f"fused parts need one input size, got {sorted(widths)}")
        zero = None if mode == "int8" else torch.cat([part.zero for part in parts])
        return cls(
            mode,
            widths.pop(),
            torch.cat([part.q for part in parts]),
            torch.cat([part.scale for part in parts]),
            zero,
            bias,
            float_inputs,
        )

    # -- compute ----------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            y = self._forward_rows(x.reshape(-1, self.in_features))
            return y.view(*x.shape[:-1], self.out_features)
        return self._forward_rows(x)

    def _forward_rows(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x if dtype == torch.float32 and x.stride(-1) == 1 else x.float().contiguous()
        if xf.shape[0] < self.dense_min_rows:
            y = cpu_kernels.linear(self.spec, xf)  # adds the bias
        else:
            y = self._dense_matmul(xf)
        return y if dtype == torch.float32 else y.to(dtype)

    def _dense_matmul(self, x: torch.Tensor) -> torch.Tensor:
        step = max(1, _DENSE_CHUNK_ELEMENTS // self.in_features)
        outputs = [
            F.linear(x, self.dequantize(start, min(start + step, self.out_features)))
            for start in range(0, self.out_features, step)
        ]
        y = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
        return y if self.bias is None else y.add_(self.bias)

    def dequantize(self, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Float32 weight rows ``[start, end)`` exactly as the kernel sees them."""
        end = self.out_features if end is None else end
        if not 0 <= start <= end <= self.out_features:
            raise IndexError(f"rows [{start}, {end}) out of range for {self.out_features} rows")
        return cpu_kernels.dequantize_rows(self.spec, torch.arange(start, end))

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized float32 rows ``W[ids]`` (an embedding lookup), shape ``[*ids.shape, K]``."""
        flat = ids.reshape(-1).long().contiguous()
        if flat.numel() and not (0 <= int(flat.min()) and int(flat.max()) < self.out_features):
            raise IndexError(f"ids out of range for a table of {self.out_features} rows")
        rows = cpu_kernels.dequantize_rows(self.spec, flat)
        return rows.view(*ids.shape, self.in_features)

    def _sync_spec(self) -> None:
        # The kernels read these exact formats: a module-wide .to(dtype) must not go unnoticed.
        if (
            self.scale.dtype != torch.float16
            or self.qweight.device.type != "cpu"
            or (self.bias is not None and self.bias.dtype != torch.float32)
        ):
            raise TypeError(
                "quantized layers keep float16 scales and a float32 bias on the CPU; "
                "cast the inputs instead of the module"
            )
        kind = cpu_kernels.LINEAR_Q8_FLOAT_INPUT if self.float_inputs else _KIND[self.mode]
        self.spec = cpu_kernels.linear_spec(
            kind, self.qweight, self.in_features, self.scale, self.zero, self.bias
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"mode={self.mode}, bias={self.bias is not None}, float_inputs={self.float_inputs}, "
            f"dense_min_rows={self.dense_min_rows}"
        )


class _BatchLinear(_KernelLinear):
    """A copy of a layer's weights laid out for the C kernels' tiled GEMM (``linear_tiled``)."""

    in_features: int
    out_features: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        xf = (
            rows
            if rows.dtype == torch.float32 and rows.stride(-1) == 1
            else rows.float().contiguous()
        )
        y = cpu_kernels.linear(self.spec, xf)
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class FixedPointLinear(_BatchLinear):
    """``y = x W^T (+ b)`` for batches on CPU: ``W`` rounded once to 14-bit integers per output
    row, each input row to 13-bit integers per 64 values, integer products summed exactly per
    64 (``LINEAR_I16`` in cpu_kernels.c). Error ~2e-4 of an output row's norm (the int8
    kernels': ~5e-3); half float32's weight bytes, and 1.4-2.5x MKL's float32 GEMM at 16 to
    4096 rows on AVX2 (scripts/BENCHMARKS.md, change 15).

    ``--quantization auto`` gives one to every projection and the LM head of a GGUF model, for
    every step of ``AUTO_MAX_ROWS`` rows or more with prefill rows (and for decode steps too
    where the blocks are int8: the default model's LM head).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if not cpu_kernels.available():
            raise QuantizationError("fixed-point layers need nanokv's C kernels")
        self.out_features, self.in_features = weight.shape
        packed, scale = cpu_kernels.pack_i16(weight)
        self.register_buffer("packed", packed)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        self._sync_spec()

    def _sync_spec(self) -> None:
        if self.scale.dtype != torch.float32 or self.packed.device.type != "cpu":
            raise TypeError(
                "fixed-point layers keep int32-packed weights and float32 scales on the CPU"
            )
        self.spec = cpu_kernels.linear_spec(
            cpu_kernels.LINEAR_I16,
            self.packed,
            self.in_features,
            self.scale,
            bias=self.bias,
            out_features=self.out_features,
        )


class PanelInt4Linear(_BatchLinear):
    """``y = x W^T (+ b)`` for batches on CPU over an int4 layer's own blocks, unpacked to a byte
    per weight in panels of 16 outputs (``LINEAR_Q4_PANELS`` in cpu_kernels.c). Inputs are
    rounded to int8 per 32 exactly as the int4 kernel rounds them, so a batch computes the
    products a single row does (llama.cpp's arithmetic), 32 per AVX2 instruction in a tiled
    GEMM: 1.25-1.35x the fixed-point copy, 1.7-2.4x MKL (scripts/BENCHMARKS.md, change 19).

    ``--quantization auto`` gives one to every int4 layer of a GGUF model (the default model's
    projections), for decode steps of ``AUTO_MAX_ROWS`` rows or more. Not for prefills: a
    prompt's K/V feed every later token, and rounding its inputs to int8 moved the default
    model's next-token KL from 1e-5 to 4e-3 and its answer to a chat question (change 19).
    """

    def __init__(self, layer: QuantizedLinear) -> None:
        super().__init__()
        if layer.mode != "int4":
            raise QuantizationError(f"PanelInt4Linear takes an int4 layer, not {layer.mode}")
        self.out_features, self.in_features = layer.out_features, layer.in_features
        self.register_buffer("packed", cpu_kernels.pack_q4_panels(layer.spec))
        self.register_buffer("bias", layer.bias)
        self._sync_spec()

    def _sync_spec(self) -> None:
        if self.packed.device.type != "cpu":
            raise TypeError("int4 panels stay on the CPU")
        self.spec = cpu_kernels.linear_spec(
            cpu_kernels.LINEAR_Q4_PANELS,
            self.packed,
            self.in_features,
            bias=self.bias,
            out_features=self.out_features,
        )


class QuantizedEmbedding(nn.Module):
    """Token embedding that reads rows out of a (possibly shared) quantized table."""

    def __init__(self, table: QuantizedLinear) -> None:
        super().__init__()
        self.table = table

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.table.embedding(input_ids)


# -- quantizing float weights -------------------------------------------------------------------


def check_shape(rows: int, cols: int, mode: str) -> None:
    """Raise QuantizationError unless a [rows, cols] weight can be held in ``mode``."""
    if mode not in MODES:
        raise QuantizationError(f"unknown quantization mode {mode!r} (choose from {MODES})")
    if cols % GROUP_SIZE:
        raise QuantizationError(
            f"{mode} needs in_features % {GROUP_SIZE} == 0, got a [{rows}, {cols}] weight"
        )


def _quantize(weight: torch.Tensor, mode: str) -> _Groups:
    if weight.dim() != 2:
        raise QuantizationError(f"expected a 2-D weight, got shape {tuple(weight.shape)}")
    check_shape(weight.shape[0], weight.shape[1], mode)
    groups = weight.detach().float().view(weight.shape[0], -1, GROUP_SIZE)
    return _quantize_int8(groups) if mode == "int8" else _quantize_int4(groups)


def _quantize_int8(groups: torch.Tensor) -> _Groups:
    """Symmetric groups (Q8_0); weights are rounded against the float16 scale."""
    scale = (groups.abs().amax(dim=2) / 127.0).half()
    q = torch.round(groups * _inverse(scale)[..., None]).clamp_(-127, 127).to(torch.int8)
    return _Groups(q.view(groups.shape[0], -1), scale, None)


def _quantize_int4(groups: torch.Tensor) -> _Groups:
    """Asymmetric min/max groups (Q4_1), rounded against the float16 scale and zero."""
    low, high = groups.amin(dim=2), groups.amax(dim=2)
    scale, zero = ((high - low) / 15.0).half(), low.half()
    shifted = groups - zero.float()[..., None]
    q = torch.round(shifted * _inverse(scale)[..., None]).clamp_(0, 15).to(torch.uint8)
    return _Groups(_pack_nibbles(q), scale, zero)


def _inverse(scale: torch.Tensor) -> torch.Tensor:
    scale = scale.float()
    return 1.0 / torch.where(scale > 0, scale, torch.ones_like(scale))


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 values 0..15 [N, G, 32] -> GGUF's nibble order [N, G * 16]."""
    return (q[..., :16] | (q[..., 16:] << 4)).reshape(q.shape[0], -1)


# -- GGUF blocks --------------------------------------------------------------------------------


def _convert_gguf(
    raw: np.ndarray | torch.Tensor, qtype: Any, shape: Sequence[int], mode: str
) -> _Groups:
    rows, cols = (int(d) for d in shape)
    kind = int(getattr(qtype, "value", qtype))
    data = _as_bytes(raw, rows)
    check_shape(rows, cols, mode)
    if mode == "int4" and kind in (_Q4_0, _Q4_1):
        blocks = _block_fields(data, rows, cols, 20 if kind == _Q4_1 else 18)
        scale = _half(blocks, 0)
        zero = _half(blocks, 2) if kind == _Q4_1 else scale * -8.0  # exact: a power of two
        packed = blocks[..., 4 if kind == _Q4_1 else 2 :].reshape(rows, cols // 2)
        return _Groups(packed.contiguous(), scale, zero)
    if mode == "int8" and kind == _Q8_0:
        blocks = _block_fields(data, rows, cols, 34)
        q = blocks[..., 2:].contiguous().view(torch.int8).view(rows, cols)
        return _Groups(q, _half(blocks, 0), None)
    return _quantize(gguf_dequantize(data, kind, rows, cols), mode)


def _as_bytes(raw: np.ndarray | torch.Tensor, rows: int) -> torch.Tensor:
    if isinstance(raw, np.ndarray):
        with warnings.catch_warnings():
            # GGUF tensors are read-only views of the file mapping; they are only read here.
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8))
    return raw.contiguous().view(torch.uint8).reshape(rows, -1)


def _block_fields(data: torch.Tensor, rows: int, cols: int, block_bytes: int) -> torch.Tensor:
    if cols % GROUP_SIZE or data.shape[1] != cols // GROUP_SIZE * block_bytes:
        raise QuantizationError(
            f"GGUF data of {data.shape[1]} bytes per row does not fit a [{rows}, {cols}] weight"
        )
    return data.view(rows, cols // GROUP_SIZE, block_bytes)


def _half(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    return blocks[..., offset : offset + 2].contiguous().view(torch.float16)[..., 0]


def gguf_dequantize(
    raw: np.ndarray | torch.Tensor, qtype: Any, rows: int, cols: int
) -> torch.Tensor:
    """Float32 ``[rows, cols]`` values of a GGUF tensor of any type gguf-py can decode."""
    from gguf.quants import dequantize

    kind = int(getattr(qtype, "value", qtype))
    data = _as_bytes(raw, rows)
    if kind == _Q8_0:
        blocks = _block_fields(data, rows, cols, 34)
        q = blocks[..., 2:].contiguous().view(torch.int8).float()
        return (q * _half(blocks, 0).float()[..., None]).view(rows, cols)
    if kind in (_F32, _F16, _BF16):
        dtype = {_F32: torch.float32, _F16: torch.float16, _BF16: torch.bfloat16}[kind]
        return data.view(dtype).view(rows, cols).float()
    from gguf import GGMLQuantizationType

    values = dequantize(data.numpy(), GGMLQuantizationType(kind))
    return torch.from_numpy(np.asarray(values, dtype=np.float32).reshape(rows, cols))
