"""Weight-only quantized linear layers for CPU, on PyTorch's int8 and int4 weight-only kernels.

At batch 1 a CPU decode step is bound by the bytes of weights it reads, so keeping weights in
8 or 4 bits beats a dense matmul. Three storage modes:

- ``int8``: per-output-channel symmetric int8, ``aten._weight_int8pack_mm``.
- ``int4``: 4-bit groups of 32 along the input dimension with a bf16 scale and zero per group,
  ``aten._weight_int4pack_mm_for_cpu``. The kernel dequantizes ``(q - 8) * scale + zero``, an
  affine form that holds GGUF's Q4_0 (``d * (q - 8)``) and Q4_1 (``d * q + m``) exactly.
- ``int4x2``: 8-bit groups of 32 held as two int4 planes (``q = 16 * hi + lo``) side by side
  along the input dimension and run through the int4 kernel with the input repeated, so
  ``W x = W_hi x + W_lo x``. It holds GGUF's Q8_0 exactly, which per-channel ``int8`` cannot
  (a Q8_0 row has one scale per 32 weights), at 1.25 bytes per weight.

Both kernels need bf16 activations for their vectorized paths (float32 falls to scalar code),
so the quantized path runs in bf16 and returns the caller's dtype. Batches of
``dense_min_rows`` rows or more (prefill, large decode batches) are cheaper as a float32 GEMM:
those weights are dequantized on the fly in row chunks, so no dense copy stays resident.

The int4 packed layout depends on the CPU's vector width (it is chosen by the kernel build
that runs): never store packed weights on disk, pack at load.

Measured with scripts/profile_quant.py (SmolLM2-135M shapes, 30 layers, fused qkv and gate/up;
AVX2 CPU, 1 thread, shared machine, per-layer minimums), linear layers per decode step at
batch 1: float32 28-33 ms, int8 20 ms, int4 17 ms (10 ms on 2 threads), int4x2 32 ms. At 64
rows the kernels lose (int8 450, int4 345, float32 190-250 ms) and the dequantize path costs
about float32's: it reads fewer bytes, which pays for the dequantization. Resident: float32
425 MB, int8 106 MB, int4 66 MB, int4x2 133 MB; a 49152 x 576 LM head 113 / 28 / 18 / 35 MB.
On the default model (Q4_1 layers, Q8_0 embeddings), int4 layers with an int8 LM head and
embedding table: 95 MB, next-token KL 1.7e-3 against the float32 model of the same file
(int4x2 head: 7e-4 but a 3x slower head; int4 head from Q8_0: 7e-2).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

QuantMode = Literal["int8", "int4", "int4x2"]
MODES: tuple[str, ...] = ("int8", "int4", "int4x2")
GROUP_SIZE = 32
# Rows (tokens) from which dequantizing to float32 and running a dense GEMM beats the mode's
# weight-only kernel, whose cost grows with every row (it dequantizes per 4-row tile). The
# crossovers measured by scripts/profile_quant.py: int8 16-32, int4 48-96, int4x2 48-96.
DENSE_MIN_ROWS: dict[str, int] = {"int8": 32, "int4": 64, "int4x2": 48}
# Elements dequantized at a time on the dense path: 4 MB of float32 stays in cache for the GEMM.
_DENSE_CHUNK_ELEMENTS = 1 << 20
_PACK_CHUNK_ROWS = 4096  # bounds the int32 copy the int4 packer needs
# GGML type numbers (gguf.GGMLQuantizationType) decoded here without a float round trip.
_F32, _F16, _Q4_0, _Q4_1, _Q8_0, _BF16 = 0, 1, 2, 3, 8, 30


class QuantizationError(ValueError):
    """A weight cannot be quantized as asked (shape, mode or GGUF type)."""


@dataclass
class _Int4Groups:
    """Unpacked int4 weights: ``w[n, k] = (q[n, k] - 8) * scale[n, k // 32] + zero[n, k // 32]``."""

    q: torch.Tensor  # uint8 [N, K'] in 0..15; K' = planes * in_features
    scale: torch.Tensor  # float32 [N, K' / 32]
    zero: torch.Tensor  # float32 [N, K' / 32]


# A part before packing: int8 (q [N, K], bf16 scale [N]) or int4 groups.
_Unpacked = tuple[torch.Tensor, torch.Tensor] | _Int4Groups


class QuantizedLinear(nn.Module):
    """``y = x W^T (+ b)`` with ``W`` held in int8 or int4; CPU only.

    Build with ``from_float`` (quantize a float weight) or ``from_gguf`` (convert GGUF blocks),
    fuse projections with ``cat``. ``forward`` takes ``[..., in_features]`` in any float dtype
    and returns the same dtype. ``embedding(ids)`` gathers dequantized rows, so a tied embedding
    table and LM head can share one quantized copy.
    """

    def __init__(
        self,
        mode: QuantMode,
        in_features: int,
        out_features: int,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        if mode not in MODES:
            raise QuantizationError(f"unknown quantization mode {mode!r} (choose from {MODES})")
        self.mode = mode
        self.in_features = in_features
        self.out_features = out_features
        self.planes = 2 if mode == "int4x2" else 1
        self.dense_min_rows: float = DENSE_MIN_ROWS[mode]
        # int8: qweight int8 [N, K], scales bf16 [N].
        # int4*: qweight uint8 [N, K'/2] in the kernel's layout, scales bf16 [K'/32, N, 2].
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        self._sync_fast_path()

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
        """Convert a GGUF tensor's raw blocks (``shape`` = (out, in), torch order).

        Exact where the kernel's format can hold the GGUF one (up to bf16 scales): Q4_0 and
        Q4_1 to ``int4``, Q8_0 to ``int4x2``. Other pairs requantize the dequantized weight:
        any type to ``int8`` (per-channel), Q8_0 or float to ``int4`` (4-bit groups).
        """
        return cls._build(mode, [_convert_gguf(raw, qtype, shape, mode)], bias)

    @classmethod
    def from_parts(
        cls, parts: Sequence[Any], mode: QuantMode, bias: torch.Tensor | None = None
    ) -> QuantizedLinear:
        """A fused projection (qkv, gate/up): ``parts`` stacked along the output dimension.

        Each part is a float weight or a GGUF tensor (``loader.QuantizedTensor``: ``data``,
        ``qtype``, ``shape``); mixed GGUF types are fine. Quantization works per row and per
        group along the input, so fusing first or after gives the same weights.
        """
        unpacked = [
            _quantize(part, mode)
            if isinstance(part, torch.Tensor)
            else _convert_gguf(part.data, part.qtype, part.shape, mode)
            for part in parts
        ]
        return cls._build(mode, unpacked, bias)

    @classmethod
    def cat(cls, layers: Sequence[QuantizedLinear]) -> QuantizedLinear:
        """Fuse built layers of the same input size and mode along the output dimension."""
        modes = {layer.mode for layer in layers}
        if len(modes) != 1:
            raise QuantizationError(f"fused layers need one mode, got {sorted(modes)}")
        bias = None
        if any(layer.bias is not None for layer in layers):
            bias = torch.cat(
                [torch.zeros(x.out_features) if x.bias is None else x.bias for x in layers]
            )
        return cls._build(layers[0].mode, [layer._unpacked() for layer in layers], bias)

    @classmethod
    def _build(
        cls, mode: QuantMode, parts: Sequence[_Unpacked], bias: torch.Tensor | None
    ) -> QuantizedLinear:
        widths = {
            part[0].shape[1] if isinstance(part, tuple) else part.q.shape[1] for part in parts
        }
        if len(widths) != 1:
            raise QuantizationError(f"fused parts need one input size, got {sorted(widths)}")
        if mode == "int8":
            q = torch.cat([part[0] for part in parts])
            scales = torch.cat([part[1] for part in parts])
            return cls(mode, q.shape[1], q.shape[0], q.contiguous(), scales.contiguous(), bias)
        q = torch.cat([part.q for part in parts])
        # The kernel reads scale and zero interleaved, group-major: [K'/32, N, 2].
        params = [torch.stack([part.scale, part.zero], dim=-1) for part in parts]
        scales = torch.cat(params).transpose(0, 1).to(torch.bfloat16).contiguous()
        in_features = q.shape[1] // (2 if mode == "int4x2" else 1)
        return cls(mode, in_features, q.shape[0], _pack_int4(q), scales, bias)

    def _unpacked(self) -> _Unpacked:
        if self.mode == "int8":
            return self.qweight, self.scales
        params = self.scales.float().transpose(0, 1)  # [N, K'/32, 2]
        q = _unpack_int4(self.qweight, 0, self.out_features)
        return _Int4Groups(q, params[..., 0].contiguous(), params[..., 1].contiguous())

    # -- compute ----------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            y = self._forward_rows(x.reshape(-1, self.in_features))
            return y.view(*x.shape[:-1], self.out_features)
        return self._forward_rows(x)

    def _forward_rows(self, x: torch.Tensor) -> torch.Tensor:
        # Runs once per layer per step: plain attributes, dtype checks before conversions and
        # torch.* bindings keep the Python cost per call small (torch.ops dispatch, buffer
        # lookups and no-op .to() calls each cost microseconds).
        dtype = x.dtype
        if 0 < x.shape[0] < self.dense_min_rows:
            y = self._kernel_matmul(x if dtype == torch.bfloat16 else x.bfloat16())
            if dtype != torch.bfloat16:
                y = y.float() if dtype == torch.float32 else y.to(dtype)
        else:
            y = self._dense_matmul(x)
            if dtype != torch.float32:
                y = y.to(dtype)
        if self._bias is not None:
            y += self._bias if dtype == torch.float32 else self._bias.to(dtype)
        return y

    def _kernel_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """The weight-only kernel on bf16 rows ``x`` [M, K] (M > 0); bf16 result."""
        qweight, scales = self._kernel_args
        if not x.is_contiguous():
            x = x.contiguous()
        if self.planes == 2:
            x = torch.cat([x, x], dim=1)
        elif self.mode == "int8":
            return torch._weight_int8pack_mm(x, qweight, scales)
        return torch._weight_int4pack_mm_for_cpu(x, qweight, GROUP_SIZE, scales)

    def _apply(self, fn: Any, recurse: bool = True) -> QuantizedLinear:
        result = super()._apply(fn, recurse)
        self._sync_fast_path()
        return result

    def _sync_fast_path(self) -> None:
        """Mirror the buffers in plain attributes, which the per-call path reads faster."""
        self._kernel_args = (self.qweight, self.scales)
        self._bias = self.bias

    def _dense_matmul(self, rows: torch.Tensor) -> torch.Tensor:
        xf = rows.float()
        step = _dense_chunk_rows(self.in_features * self.planes)
        outputs = []
        for start in range(0, self.out_features, step):
            end = min(start + step, self.out_features)
            if self.mode == "int8":
                outputs.append(F.linear(xf, self.dequantize(start, end)))
            else:
                outputs.append(torch.mm(xf, self._int4_weight_t(start, end)))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)

    def _int4_weight_t(self, start: int, end: int) -> torch.Tensor:
        """Transposed float32 weight rows ``[start, end)`` as ``[in_features, end - start]``.

        Built from the packed bytes without unpacking to row order: the kernel's layout keeps
        each input index's nibbles for a block of rows together, which is the transposed
        matrix's order, and contiguous rows of the transposed matrix let the scale and zero
        broadcast along the fast dimension (transposes and mixed-dtype ops are slow on CPU).
        """
        layout = _pack_layout()
        if layout is None:
            return self.dequantize(start, end).t()
        half_k = self.qweight.shape[1]
        k, n, bn = 2 * half_k, end - start, layout.block_n
        weight_t = torch.empty(k, n)
        flat = self.qweight.reshape(-1)[start * half_k : end * half_k]
        full, tail = divmod(n, bn)
        if full:
            blocks = flat[: full * bn * half_k].view(full, k, bn // 2)
            _scatter_nibbles(weight_t[:, : full * bn], blocks, layout.split)
        if tail:  # a short last block pairs its rows
            blocks = flat[full * bn * half_k :].view(1, k, tail // 2)
            _scatter_nibbles(weight_t[:, full * bn :], blocks, split=False)
        params = self.scales[:, start:end].float()  # [K'/32, n, 2]
        scale = params[..., 0].contiguous()
        offset = params[..., 1] - 8.0 * scale  # (q - 8) * scale + zero = q * scale + offset
        weight_t.view(-1, GROUP_SIZE, n).mul_(scale[:, None]).add_(offset[:, None])
        if self.planes == 2:
            return weight_t[: self.in_features].add_(weight_t[self.in_features :])
        return weight_t

    def dequantize(self, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Float32 weight rows ``[start, end)`` exactly as the kernel sees them.

        For int4 modes ``start`` must be a multiple of 64 (a packing-block boundary).
        """
        end = self.out_features if end is None else end
        if self.mode == "int8":
            return self.qweight[start:end].float().mul_(self.scales[start:end, None].float())
        q = _unpack_int4(self.qweight, start, end)
        return self._int4_values(q, self.scales[:, start:end])

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized float32 rows ``W[ids]`` (an embedding lookup), shape ``[*ids.shape, K]``."""
        flat = ids.reshape(-1)
        if self.mode == "int8":
            values = self.qweight[flat].float() * self.scales[flat, None].float()
        else:
            q = _gather_int4_rows(self.qweight, flat)
            values = self._int4_values(q, self.scales[:, flat])
        return values.view(*ids.shape, self.in_features)

    def _int4_values(self, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """``(q - 8) * scale + zero`` for rows ``q`` [n, K'] and their scales [K'/32, n, 2]."""
        n = q.shape[0]
        params = scales.float().permute(1, 0, 2)  # [n, K'/32, 2]
        grouped = q.view(n, -1, GROUP_SIZE).float().sub_(8.0)
        values = grouped.mul_(params[..., :1]).add_(params[..., 1:]).view(n, -1)
        if self.planes == 2:
            values = values[:, : self.in_features] + values[:, self.in_features :]
        return values

    @property
    def nbytes(self) -> int:
        """Resident bytes of the quantized weight, its scales and the bias."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"mode={self.mode}, bias={self.bias is not None}, dense_min_rows={self.dense_min_rows}"
        )


class QuantizedEmbedding(nn.Module):
    """Token embedding that reads rows out of a (possibly shared) quantized table."""

    def __init__(self, table: QuantizedLinear) -> None:
        super().__init__()
        self.table = table

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.table.embedding(input_ids)


# -- quantizing float weights -------------------------------------------------------------------


def _quantize(weight: torch.Tensor, mode: str) -> _Unpacked:
    if weight.dim() != 2:
        raise QuantizationError(f"expected a 2-D weight, got shape {tuple(weight.shape)}")
    _check_shape(weight.shape[0], weight.shape[1], mode)
    weight = weight.detach().float()
    if mode == "int8":
        return _quantize_int8(weight)
    return _quantize_int4(weight) if mode == "int4" else _quantize_int4x2(weight)


def _convert_gguf(
    raw: np.ndarray | torch.Tensor, qtype: Any, shape: Sequence[int], mode: str
) -> _Unpacked:
    rows, cols = (int(d) for d in shape)
    kind = int(getattr(qtype, "value", qtype))
    data = _as_bytes(raw, rows)
    if mode == "int4" and kind in (_Q4_0, _Q4_1):
        _check_shape(rows, cols, mode)
        return _decode_q4(data, rows, cols, kind == _Q4_1)
    if mode == "int4x2" and kind == _Q8_0:
        _check_shape(rows, cols, mode)
        return _q8_0_planes(*_decode_q8_0(data, rows, cols))
    return _quantize(gguf_dequantize(data, kind, rows, cols), mode)


def _check_shape(rows: int, cols: int, mode: str) -> None:
    if mode not in MODES:
        raise QuantizationError(f"unknown quantization mode {mode!r} (choose from {MODES})")
    # The int4 kernel works on 16-row tiles and whole 32-wide groups.
    if mode != "int8" and (cols % GROUP_SIZE or rows % 16):
        raise QuantizationError(
            f"{mode} needs in_features % {GROUP_SIZE} == 0 and out_features % 16 == 0, "
            f"got a [{rows}, {cols}] weight"
        )


def _quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8; the scale is rounded to bf16 before the weights are rounded."""
    scale = (weight.abs().amax(dim=1) / 127.0).to(torch.bfloat16)
    inverse = 1.0 / torch.where(scale > 0, scale.float(), torch.ones_like(scale.float()))
    q = torch.round(weight * inverse[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def _quantize_int4(weight: torch.Tensor) -> _Int4Groups:
    """Asymmetric min/max 4-bit groups (Q4_1-like), rounded against the bf16 scale and zero."""
    n = weight.shape[0]
    groups = weight.view(n, -1, GROUP_SIZE)
    low, high = groups.amin(dim=2), groups.amax(dim=2)
    scale = _bf16((high - low) / 15.0)
    zero = _bf16(low + 8.0 * scale)
    base = zero - 8.0 * scale  # the value of q = 0 as the kernel computes it
    inverse = 1.0 / torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((groups - base[..., None]) * inverse[..., None]).clamp_(0, 15)
    return _Int4Groups(q.to(torch.uint8).view(n, -1), scale, zero)


def _quantize_int4x2(weight: torch.Tensor) -> _Int4Groups:
    """Symmetric 8-bit groups of 32 (as Q8_0) split into two int4 planes."""
    groups = weight.view(weight.shape[0], -1, GROUP_SIZE)
    scale = _bf16(groups.abs().amax(dim=2) / 127.0)
    inverse = 1.0 / torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(groups * inverse[..., None]).clamp_(-127, 127).to(torch.int8)
    return _q8_0_planes(q.view(weight.shape), scale)


def _q8_0_planes(q: torch.Tensor, scale: torch.Tensor) -> _Int4Groups:
    """int8 q [N, K] with per-group scale [N, K/32] -> planes [hi | lo] with q = 16 * hi + lo."""
    hi = torch.bitwise_right_shift(q, 4)  # arithmetic shift: floor(q / 16) in -8..7
    lo = torch.bitwise_and(q, 15)  # 0..15
    planes = torch.cat([hi + 8, lo], dim=1).to(torch.uint8)
    # hi plane: (hi + 8 - 8) * 16d + 0; lo plane: (lo - 8) * d + 8d. 16d and 8d are exact in bf16.
    return _Int4Groups(
        planes,
        torch.cat([16.0 * scale, scale], dim=1),
        torch.cat([torch.zeros_like(scale), 8.0 * scale], dim=1),
    )


def _bf16(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.bfloat16).float()


# -- GGUF blocks --------------------------------------------------------------------------------


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
    return blocks[..., offset : offset + 2].contiguous().view(torch.float16)[..., 0].float()


def _decode_q4(data: torch.Tensor, rows: int, cols: int, has_min: bool) -> _Int4Groups:
    """Q4_0 (``d * (q - 8)``) or Q4_1 (``d * q + m``) blocks to the kernel's affine form."""
    blocks = _block_fields(data, rows, cols, 20 if has_min else 18)
    scale = _half(blocks, 0)
    # Byte j of a block holds element j in its low nibble and element j + 16 in its high one.
    packed = blocks[..., 4 if has_min else 2 :]
    q = torch.cat([packed & 15, packed >> 4], dim=2).view(rows, cols)
    zero = _half(blocks, 2) + 8.0 * scale if has_min else torch.zeros_like(scale)
    return _Int4Groups(q, scale, zero)


def _decode_q8_0(data: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = _block_fields(data, rows, cols, 34)
    q = blocks[..., 2:].contiguous().view(torch.int8).view(rows, cols)
    return q, _half(blocks, 0)


def gguf_dequantize(
    raw: np.ndarray | torch.Tensor, qtype: Any, rows: int, cols: int
) -> torch.Tensor:
    """Float32 ``[rows, cols]`` values of a GGUF tensor of any type gguf-py can decode."""
    from gguf.quants import dequantize

    kind = int(getattr(qtype, "value", qtype))
    data = _as_bytes(raw, rows)
    if kind == _Q8_0:
        q, scale = _decode_q8_0(data, rows, cols)
        return (q.view(rows, -1, GROUP_SIZE).float() * scale[..., None]).view(rows, cols)
    if kind in (_F32, _F16, _BF16):
        dtype = {_F32: torch.float32, _F16: torch.float16, _BF16: torch.bfloat16}[kind]
        return data.view(dtype).view(rows, cols).float()
    from gguf import GGMLQuantizationType

    values = dequantize(data.numpy(), GGMLQuantizationType(kind))
    return torch.from_numpy(np.asarray(values, dtype=np.float32).reshape(rows, cols))


# -- int4 packing -------------------------------------------------------------------------------


def _pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 values 0..15 [N, K] -> the CPU kernel's packed uint8 [N, K/2]."""
    convert = torch.ops.aten._convert_weight_to_int4pack_for_cpu
    # Packing blocks are at most 64 rows and laid out one after another, so packing row chunks
    # that are multiples of 64 and concatenating them gives the same bytes with less memory.
    chunks = [
        convert(q[start : start + _PACK_CHUNK_ROWS].to(torch.int32).contiguous(), 1)
        for start in range(0, q.shape[0], _PACK_CHUNK_ROWS)
    ]
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks)


@dataclass(frozen=True)
class _PackLayout:
    """How ``_convert_weight_to_int4pack_for_cpu`` arranges nibbles on this CPU.

    Rows come in blocks of ``block_n``; block b holds ``[K, nb / 2]`` bytes (nb = its rows).
    A full block in the ``split`` layout keeps row r in byte column ``r % (nb/2)``, low nibble
    for the first half of the rows; otherwise (and in a short last block) rows pair up: byte
    column ``r // 2``, low nibble for even r.
    """

    block_n: int
    split: bool


@cache
def _pack_layout() -> _PackLayout | None:
    """Find the layout by packing a probe (it depends on the kernel's vector width)."""
    rows, cols = 272, 64  # 272 = 2*128+16 = 4*64+16 = 8*32+16: full blocks and a short one
    probe = torch.randint(0, 16, (rows, cols), generator=torch.Generator().manual_seed(0))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe.to(torch.int32), 1)
    for block_n in (64, 32, 16, 128):
        for split in (True, False):
            layout = _PackLayout(block_n, split)
            if torch.equal(_unpack_with(layout, packed, 0, rows).long(), probe):
                return layout
    return None


def _unpack_int4(packed: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Rows ``[start, end)`` of packed int4 weights as uint8 [end - start, K]."""
    layout = _pack_layout()
    if layout is None:
        return _unpack_with_kernel(packed)[start:end]
    if start % layout.block_n:
        raise QuantizationError(f"row {start} is not at an int4 packing block boundary")
    return _unpack_with(layout, packed, start, end)


def _unpack_with(layout: _PackLayout, packed: torch.Tensor, start: int, end: int) -> torch.Tensor:
    rows, half_k = packed.shape
    k, bn = 2 * half_k, layout.block_n
    end = min(end, rows)
    full, tail = divmod(end - start, bn)
    if tail and end != rows:  # only the matrix's last block can be short
        raise QuantizationError(f"row {end} is not at an int4 packing block boundary")
    flat = packed.reshape(-1)
    parts = []
    if full:
        blocks = flat[start * half_k : (start + full * bn) * half_k].view(full, k, bn // 2)
        nibbles = [blocks & 15, blocks >> 4]
        if layout.split:  # rows [0, bn/2) low, [bn/2, bn) high
            q = torch.cat(nibbles, dim=2)
        else:  # rows interleave: 2c low, 2c + 1 high
            q = torch.stack(nibbles, dim=3).view(full, k, bn)
        parts.append(q.transpose(1, 2).reshape(full * bn, k))
    if tail:
        block = flat[(end - tail) * half_k : end * half_k].view(k, tail // 2)
        parts.append(torch.stack([block & 15, block >> 4], dim=2).view(k, tail).t())
    return parts[0].contiguous() if len(parts) == 1 else torch.cat(parts)


def _unpack_with_kernel(packed: torch.Tensor) -> torch.Tensor:
    """Unknown layout: let the kernel decode it (scale 1, zero 8 gives q back), slowly."""
    n, k = packed.shape[0], 2 * packed.shape[1]
    eye = torch.eye(k, dtype=torch.bfloat16)
    ones = torch.tensor([1.0, 8.0], dtype=torch.bfloat16).expand(k // GROUP_SIZE, n, 2)
    q = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, packed, GROUP_SIZE, ones.contiguous())
    return q.t().to(torch.uint8).contiguous()


def _gather_int4_rows(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Arbitrary rows of packed int4 weights as uint8 [len(ids), K] (embedding lookups)."""
    layout = _pack_layout()
    if layout is None:
        return _unpack_with_kernel(packed)[ids]
    rows, half_k = packed.shape
    k, bn = 2 * half_k, layout.block_n
    ids = ids.long()
    block_start = ids - ids % bn
    block_rows = torch.clamp(rows - block_start, max=bn)  # a short last block pairs its rows
    r = ids - block_start
    split = (block_rows == bn) & layout.split
    half = block_rows // 2
    column = torch.where(split, r % half, r // 2)
    shift = torch.where(split, r // half, r % 2) * 4
    index = block_start * half_k + column
    index = index[:, None] + torch.arange(k)[None, :] * half[:, None]
    return (packed.reshape(-1)[index] >> shift[:, None].to(torch.uint8)) & 15


def _scatter_nibbles(out: torch.Tensor, blocks: torch.Tensor, split: bool) -> None:
    """Write the nibbles of packed blocks [nb, K, bn/2] as floats into ``out`` [K, nb * bn]."""
    count, k, half = blocks.shape
    target = out.view(k, count, 2 * half).permute(1, 0, 2)
    # split: low nibbles are rows [0, bn/2), high ones [bn/2, bn); pairs: even and odd rows.
    if split:
        target[..., :half].copy_(blocks & 15)
        target[..., half:].copy_(blocks >> 4)
    else:
        target[..., 0::2].copy_(blocks & 15)
        target[..., 1::2].copy_(blocks >> 4)


def _dense_chunk_rows(k: int) -> int:
    # A multiple of 64 keeps int4 chunks on packing-block boundaries.
    return max(64, _DENSE_CHUNK_ELEMENTS // k // 64 * 64)
