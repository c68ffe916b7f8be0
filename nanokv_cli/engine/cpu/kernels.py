"""Python side of nanokv's CPU kernels (``csrc/*.c``), built on first use with the system
C compiler (``build.py``) and called through ctypes.

Why leave PyTorch on the CPU:

* Paged decode attention. The torch path gathers every decoding sequence's K/V out of the paged
  cache into a contiguous buffer, then runs SDPA, whose CPU kernel is slow for 1-token queries.
  The kernel reads K and V where they lie, through the block table, each cache row once for all
  the query heads that share it (GQA), a chunk of rows ahead, accumulating in float32.
* Per-op overhead. A single sequence's decode step is ~30 layers of tiny tensors, where each
  torch op costs microseconds of dispatch. Fused here: residual add + RMSNorm, rotary in place,
  the K/V store, silu(gate) * up; and ``decode_step`` runs a whole decoder for a step of a few
  single-token rows in one call (~10 ms less Python per SmolLM2 step).
* Quantized weights. ``linear`` multiplies GGUF's blocks (Q4_0/Q4_1, Q8_0) in the packed
  formats (``formats.py``, packed by ``pack_q4`` / ``pack_q8``) by inputs rounded to int8 or int16 per 32 values, with integer
  multiply-adds in tiles blocked for L1/L2, one layout for every row count (``formats.py``
  holds the layers). Float32 weights go through the same entry point for ``decode_step``.
* A float16 KV cache (``auto``, CPUs with F16C): the store rounds K/V to float16 and the
  attention kernel converts them back as it reads, halving a decode step's cache traffic.

The kernels are vectorised with AVX2/FMA/F16C where the CPU has them (plain C elsewhere) and run
on their own thread pool (``csrc/pool.c``: work goes to whichever thread claims it, so a thread
another process holds up never stalls the step), as many threads as ``torch.get_num_threads()``
at each call. They are compiled with
``-ffp-contract=off`` so that element-wise results round as torch's separate ops do; attention,
matrix-vector products and the norm's sum of squares differ from torch's in summation order.

The library is built once per source version and CPU into nanokv's cache directory (a few
seconds). Without a compiler, or with ``NANOKV_CPU_KERNELS=0``, ``available()`` is False: every
caller stays on its torch path and quantization is unavailable.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from . import build

_i64, _ptr, _f32, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int

# Weight storage kinds of the C ``Linear`` (csrc/common.h).
LINEAR_F32, LINEAR_Q4P, LINEAR_Q8P = range(3)


class LinearSpec(ctypes.Structure):
    """A linear layer's weights as the C kernels read them (pointers: the tensors must outlive
    the spec and stay in place)."""

    _fields_ = [
        ("kind", _i64),
        ("out", _i64),
        ("in_", _i64),
        ("weight", _ptr),
        ("bias", _ptr),
    ]


class DecoderLayerSpec(ctypes.Structure):
    _fields_ = [
        ("qkv", LinearSpec),
        ("o", LinearSpec),
        ("gate_up", LinearSpec),
        ("down", LinearSpec),
        ("input_norm", _ptr),
        ("post_norm", _ptr),
        ("q_norm", _ptr),
        ("k_norm", _ptr),
        ("k_cache", _ptr),
        ("v_cache", _ptr),
    ]


class DecoderSpec(ctypes.Structure):
    _fields_ = [
        ("num_layers", _i64),
        ("hidden", _i64),
        ("heads", _i64),
        ("kv_heads", _i64),
        ("head_dim", _i64),
        ("intermediate", _i64),
        ("block_size", _i64),
        ("eps", _f32),
        ("scale", _f32),
        ("rope", _ptr),
        ("final_norm", _ptr),
        ("layers", ctypes.POINTER(DecoderLayerSpec)),
        ("cache_half", _i64),
    ]


_SIGNATURES = {
    "paged_decode_f32": (
        [_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _f32, _ptr]
        + [_i64, _int, _int],
        _int,
    ),
    "rms_norm_f32": (
        [_ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, _i64, _f32, _ptr, _i64, _int],
        None,
    ),
    "rotary_f32": ([_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _int], None),
    "store_kv_f32": ([_ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, _ptr, _ptr, _int], None),
    "cache_half_supported": ([], _int),
    "silu_mul_f32": ([_ptr, _i64, _i64, _ptr, _int], None),
    "linear_f32": ([ctypes.POINTER(LinearSpec), _ptr, _i64, _i64, _ptr, _i64, _int, _int], _int),
    "dequantize_rows_f32": ([ctypes.POINTER(LinearSpec), _ptr, _i64, _ptr, _int], None),
    "q4p_bytes": ([_i64, _i64], _i64),
    "q4p_pack": ([_ptr, _ptr, _ptr, _i64, _i64, _ptr, _int], None),
    "q8p_bytes": ([_i64, _i64], _i64),
    "q8p_pack": ([_ptr, _ptr, _i64, _i64, _ptr, _int], None),
    "decode_step_f32": (
        [ctypes.POINTER(DecoderSpec), _ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _int],
        _int,
    ),
}


def available() -> bool:
    """Whether the kernels can run here (built, or buildable now)."""
    return _library() is not None


def runs(x: torch.Tensor) -> bool:
    """Whether the kernels serve an op on ``x``: float32 on the CPU, kernels built. Layers ask
    this of their input instead of carrying a flag, so they stay device-neutral."""
    return x.dtype == torch.float32 and x.device.type == "cpu" and _library() is not None


@cache
def half_cache_supported() -> bool:
    """Whether the kernels read and write a float16 KV cache here (a CPU with F16C)."""
    return available() and bool(_library().cache_half_supported())


def _is_half(cache: torch.Tensor) -> int:
    # Checked here because a build without F16C would store nothing into a float16 cache.
    if cache.dtype == torch.float16 and not half_cache_supported():
        raise TypeError("this build of the CPU kernels has no float16 KV cache (no F16C)")
    if cache.dtype not in (torch.float32, torch.float16):
        raise TypeError(f"the CPU kernels take a float32 or float16 KV cache, not {cache.dtype}")
    return int(cache.dtype == torch.float16)


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """Decode attention of q [n, heads, dim] over the paged caches, written into ``out``.

    ``k_cache``/``v_cache``: one layer's contiguous [num_blocks, block_size, kv_heads, dim];
    ``block_tables``: contiguous int64 [n, width]; ``context_lens``: int64 [n], each >= 1 and
    covered by its table row. ``q`` and ``out``: [n, heads, dim] with heads and dim contiguous
    (row slices are fine).
    """
    n, heads, dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    failed = _library().paged_decode_f32(
        q.data_ptr(),
        q.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        context_lens.data_ptr(),
        n,
        block_tables.shape[1],
        heads,
        kv_heads,
        dim,
        block_size,
        scale,
        out.data_ptr(),
        out.stride(0),
        _is_half(k_cache),
        torch.get_num_threads(),
    )
    if failed:
        raise MemoryError("the CPU attention kernel could not allocate its score buffer")
    return out


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """RMSNorm of x's rows (last dim); with ``residual``, of ``x + residual``, stored in residual.

    x, residual and out are [n, dim] or [n, heads, dim] with the last two dims packed (token
    rows may be strided); ``out`` defaults to a new contiguous tensor and may be ``x``.
    """
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype)
    dim = x.shape[-1]
    inner = x.shape[1] if x.dim() == 3 else 1
    _library().rms_norm_f32(
        x.data_ptr(),
        x.stride(0),
        None if residual is None else residual.data_ptr(),
        0 if residual is None else residual.stride(0),
        weight.data_ptr(),
        x.shape[0] * inner,
        inner,
        dim,
        eps,
        out.data_ptr(),
        out.stride(0),
        torch.get_num_threads(),
    )
    return out


def rotary_(x: torch.Tensor, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotate x [n, heads, dim] (heads and dim packed) in place; ``table`` [positions, 2, dim]
    holds cos duplicated and sin with its first half negated; ``positions`` int64 [n]."""
    n, heads, dim = x.shape
    _library().rotary_f32(
        x.data_ptr(),
        x.stride(0),
        n,
        heads,
        dim,
        table.data_ptr(),
        positions.data_ptr(),
        torch.get_num_threads(),
    )
    return x


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> None:
    """k_cache/v_cache slot ``slots[i]`` = k[i]/v[i]; k, v [n, kv_heads, dim] with heads and
    dim packed (token rows may be strided); caches contiguous, float32 or float16 (rounded to
    nearest; see ``half_cache_supported``)."""
    n, kv_heads, dim = k.shape
    _library().store_kv_f32(
        k.data_ptr(),
        k.stride(0),
        v.data_ptr(),
        v.stride(0),
        slots.data_ptr(),
        n,
        kv_heads * dim,
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        _is_half(k_cache),
    )


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :h]) * x[:, h:] for a contiguous [n, 2h] x."""
    n, width = x.shape
    out = torch.empty(n, width // 2, dtype=x.dtype)
    _library().silu_mul_f32(x.data_ptr(), n, width // 2, out.data_ptr(), torch.get_num_threads())
    return out


def linear_spec(
    kind: int,
    weight: torch.Tensor,
    in_features: int,
    bias: torch.Tensor | None = None,
    out_features: int | None = None,
) -> LinearSpec:
    """The C view of a linear layer: ``weight`` float32 [out, in] (``LINEAR_F32``) or a packed
    format's bytes (``pack_q4`` / ``pack_q8``, with ``out_features``); ``bias`` float32 [out]."""
    for t in (weight, bias):
        if t is not None and not t.is_contiguous():
            raise ValueError("linear_spec needs contiguous tensors")
    if kind != LINEAR_F32 and weight.numel() != packed_bytes(kind, out_features, in_features):
        raise ValueError(f"{weight.numel()} bytes are not a packed [{out_features}, {in_features}]")
    return LinearSpec(
        kind,
        weight.shape[0] if out_features is None else out_features,
        in_features,
        weight.data_ptr(),
        None if bias is None else bias.data_ptr(),
    )


def linear(
    spec: LinearSpec,
    x: torch.Tensor,
    out: torch.Tensor | None = None,
    exact_inputs: bool = False,
) -> torch.Tensor:
    """``x W^T + b`` for float32 rows ``x`` [n, in] (row stride free, columns packed).
    ``exact_inputs`` (a step holding prompt rows): ``LINEAR_Q4P`` rounds the inputs to int16
    per 32 instead of int8, as ``LINEAR_Q8P`` always does; float32 weights take them as they are."""
    if x.dim() != 2 or x.shape[1] != spec.in_ or x.dtype != torch.float32 or x.stride(1) != 1:
        raise ValueError(
            f"linear needs float32 rows [n, {spec.in_}], got {x.dtype} {tuple(x.shape)}"
        )
    n = x.shape[0]
    if out is None:
        out = torch.empty(n, spec.out, dtype=torch.float32)
    failed = _library().linear_f32(
        ctypes.byref(spec),
        x.data_ptr(),
        x.stride(0),
        n,
        out.data_ptr(),
        out.stride(0),
        int(exact_inputs),
        torch.get_num_threads(),
    )
    if failed:
        raise MemoryError("the CPU linear kernel could not allocate its input buffer")
    return out


def dequantize_rows(spec: LinearSpec, rows: torch.Tensor) -> torch.Tensor:
    """float32 weight rows ``W[rows]`` [len(rows), in] (``rows`` int64, contiguous)."""
    if rows.numel() and not (0 <= int(rows.min()) and int(rows.max()) < spec.out):
        raise IndexError(f"rows out of range for a table of {spec.out} rows")
    out = torch.empty(rows.shape[0], spec.in_, dtype=torch.float32)
    _library().dequantize_rows_f32(
        ctypes.byref(spec), rows.data_ptr(), rows.shape[0], out.data_ptr(), torch.get_num_threads()
    )
    return out


def packed_bytes(kind: int, out_features: int, in_features: int) -> int:
    """Bytes of a [out_features, in_features] layer packed as ``kind`` (LINEAR_Q4P/Q8P)."""
    name = {LINEAR_Q4P: "q4p_bytes", LINEAR_Q8P: "q8p_bytes"}[kind]
    return int(getattr(_library(), name)(out_features, in_features))


def pack_q4(nibbles: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """``LINEAR_Q4P`` bytes of Q4 blocks: ``nibbles`` uint8 [out, in / 2] in GGUF's order (byte j
    of a 32-block holds elements j and j + 16, low nibble first), ``scale`` and ``zero`` float16
    [out, in / 32] (Q4_0: ``zero = -8 * scale``)."""
    out_features, in_features = nibbles.shape[0], 2 * nibbles.shape[1]
    _check_blocks(nibbles, torch.uint8, scale, out_features, in_features)
    _check_blocks(zero, torch.float16, scale, out_features, in_features)
    packed = torch.empty(packed_bytes(LINEAR_Q4P, out_features, in_features), dtype=torch.uint8)
    nibbles, scale, zero = nibbles.contiguous(), scale.contiguous(), zero.contiguous()
    _library().q4p_pack(
        nibbles.data_ptr(),
        scale.data_ptr(),
        zero.data_ptr(),
        out_features,
        in_features,
        packed.data_ptr(),
        torch.get_num_threads(),
    )
    return packed


def pack_q8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``LINEAR_Q8P`` bytes of Q8_0 blocks: ``q`` int8 [out, in], ``scale`` float16 [out, in / 32]."""
    out_features, in_features = q.shape
    _check_blocks(q, torch.int8, scale, out_features, in_features)
    packed = torch.empty(packed_bytes(LINEAR_Q8P, out_features, in_features), dtype=torch.uint8)
    q, scale = q.contiguous(), scale.contiguous()
    _library().q8p_pack(
        q.data_ptr(),
        scale.data_ptr(),
        out_features,
        in_features,
        packed.data_ptr(),
        torch.get_num_threads(),
    )
    return packed


def _check_blocks(
    values: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor, rows: int, cols: int
) -> None:
    if rows < 1 or cols < 32 or cols % 32:
        raise ValueError(f"packed layers need [>= 1, a multiple of 32], got [{rows}, {cols}]")
    if values.dtype != dtype or values.device.type != "cpu":
        raise ValueError(f"expected a CPU {dtype} tensor, got {values.device.type} {values.dtype}")
    if scale.dtype != torch.float16 or tuple(scale.shape) != (rows, cols // 32):
        raise ValueError(
            f"scales must be float16 [{rows}, {cols // 32}], got {scale.dtype} {tuple(scale.shape)}"
        )


def decode_step(
    spec: DecoderSpec,
    hidden: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
) -> torch.Tensor:
    """A whole decoder over one token per row, in place: ``hidden`` [n, hidden] float32 holds the
    embeddings in and the final normed hidden states out. Index tensors are contiguous int64."""
    failed = _library().decode_step_f32(
        ctypes.byref(spec),
        hidden.data_ptr(),
        hidden.shape[0],
        positions.data_ptr(),
        slots.data_ptr(),
        block_tables.data_ptr(),
        block_tables.shape[1],
        context_lens.data_ptr(),
        torch.get_num_threads(),
    )
    if failed:
        raise MemoryError("the CPU decode step could not allocate its buffers")
    return hidden


@cache
def _library() -> ctypes.CDLL | None:
    lib = build.library()
    if lib is None:
        return None  # switched off, or no compiler: the torch paths serve
    for name, (argtypes, restype) in _SIGNATURES.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, restype
    return lib
