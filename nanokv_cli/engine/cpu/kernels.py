"""Python side of nanokv's CPU kernels (``csrc/*.c``), built on first use with the system
C compiler (``build.py``) and called through ctypes.

Why leave PyTorch on the CPU:

* Paged decode attention. The torch path gathers every decoding sequence's K/V out of the paged
  cache into a contiguous buffer, then runs SDPA, whose CPU kernel is slow for 1-token queries.
  The kernel reads K and V where they lie, through the block table, each cache row once for all
  the query heads that share it (GQA), a chunk of rows ahead, accumulating in float32.
* Per-op overhead. A single sequence's decode step is ~30 layers of tiny tensors, where each
  torch op costs microseconds of dispatch. Fused here: residual add + RMSNorm, rotary in place,
  the K/V store, silu(gate) * up; and a decode step replays, in one C call, the kernel calls
  the torch layers made on an earlier step of as many rows or more (``program.py``'s
  ``StepProgram``: ~10 ms less Python per SmolLM2 step).
* Quantized weights. ``linear`` multiplies GGUF's blocks (Q4_0/Q4_1, Q8_0) in the packed
  formats (``formats.py``, packed by ``pack``) by inputs rounded to int16 per 32 values, with integer
  multiply-adds in tiles blocked for L1/L2, one layout for every row count (``formats.py``
  holds the layers). Float32 weights go through the same entry point, for every row count too
  (``formats.FloatLinear``): one product per output whatever the batch, where torch's GEMM
  rounds 1-3 rows otherwise than more.
* A float16 KV cache (``auto``, CPUs with F16C): the store rounds K/V to float16 and the
  attention kernel converts them back as it reads, halving a decode step's cache traffic.

The kernels are vectorised with AVX2/FMA/F16C where the CPU has them (plain C elsewhere) and run
on their own thread pool (``csrc/pool.c``: work goes to whichever thread claims it, so a thread
another process holds up never stalls the step), as many threads as ``torch.get_num_threads()``
at each call. They are compiled with
``-ffp-contract=off`` so that element-wise results round as torch's separate ops do; attention,
matrix-vector products and the norm's sum of squares differ from torch's in summation order.

Every C function called here, its signature, the C ``Linear`` struct and the recorded step's
layout are declared once, in ``contract.py``: the build generates the C header from it, and
ctypes is typed from it.

The library is built once per source version, compiler and CPU into nanokv's cache directory (a
few seconds; ``build.py``). Without a compiler, or with ``NANOKV_CPU_KERNELS=0``, ``available()``
is False and ``status().missing`` says why: every caller stays on its torch path and
quantization is unavailable.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from . import contract
from .contract import LinearSpec
from .library import SIGNATURES
from .library import library as _library
from .program import _call, _Rows, _Threads, _Width

_i64, _ptr, _f32, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int

# Weight storage kinds of the C ``Linear`` (contract.py's LINEAR_KINDS).
LINEAR_F32, LINEAR_Q4P, LINEAR_Q8P = range(len(contract.LINEAR_KINDS))
# ctypes (argtypes, restype) of each entry point, from the contract table.
_SIGNATURES = SIGNATURES


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
    failed = _call(
        "paged_decode_f32",
        q,
        q.stride(0),
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        _Rows(n),
        _Width(block_tables.shape[1]),
        heads,
        kv_heads,
        dim,
        block_size,
        scale,
        out,
        out.stride(0),
        _is_half(k_cache),
        _Threads(),
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
    _call(
        "rms_norm_f32",
        x,
        x.stride(0),
        residual,
        0 if residual is None else residual.stride(0),
        weight,
        _Rows(x.shape[0], inner),
        inner,
        dim,
        eps,
        out,
        out.stride(0),
        _Threads(),
    )
    return out


def rotary_(x: torch.Tensor, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotate x [n, heads, dim] (heads and dim packed) in place; ``table`` [positions, 2, dim]
    holds cos duplicated and sin with its first half negated; ``positions`` int64 [n]."""
    n, heads, dim = x.shape
    _call("rotary_f32", x, x.stride(0), _Rows(n), heads, dim, table, positions, _Threads())
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
    _call(
        "store_kv_f32",
        k,
        k.stride(0),
        v,
        v.stride(0),
        slots,
        _Rows(n),
        kv_heads * dim,
        k_cache,
        v_cache,
        _is_half(k_cache),
        _Threads(),
    )


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :h]) * x[:, h:] for a contiguous [n, 2h] x."""
    n, width = x.shape
    out = torch.empty(n, width // 2, dtype=x.dtype)
    _call("silu_mul_f32", x, _Rows(n), width // 2, out, _Threads())
    return out


def linear_spec(
    kind: int,
    weight: torch.Tensor,
    in_features: int,
    bias: torch.Tensor | None = None,
    out_features: int | None = None,
) -> LinearSpec:
    """The C view of a linear layer: ``weight`` float32 [out, in] (``LINEAR_F32``) or a packed
    format's bytes (``pack``, with ``out_features``); ``bias`` float32 [out]."""
    for t in (weight, bias):
        if t is not None and not t.is_contiguous():
            raise ValueError("linear_spec needs contiguous tensors")
    if kind != LINEAR_F32 and weight.numel() != packed_bytes(kind, out_features, in_features):
        raise ValueError(f"{weight.numel()} bytes are not a packed [{out_features}, {in_features}]")
    spec = LinearSpec(
        kind,
        weight.shape[0] if out_features is None else out_features,
        in_features,
        weight.data_ptr(),
        None if bias is None else bias.data_ptr(),
    )
    spec.tensors = (weight, bias)  # what a step program recording it holds (program.py)
    return spec


def linear(spec: LinearSpec, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T + b`` for float32 rows ``x`` [n, in] (row stride free, columns packed). The
    packed formats round each row to int16 per 32 (formats.py); float32 weights take the rows
    as they are. A row's result does not depend on the other rows."""
    if x.dim() != 2 or x.shape[1] != spec.in_ or x.dtype != torch.float32 or x.stride(1) != 1:
        raise ValueError(
            f"linear needs float32 rows [n, {spec.in_}], got {x.dtype} {tuple(x.shape)}"
        )
    n = x.shape[0]
    if out is None:
        out = torch.empty(n, spec.out, dtype=torch.float32)
    failed = _call(
        "linear_f32",
        spec,
        x,
        x.stride(0),
        _Rows(n),
        out,
        out.stride(0),
        _Threads(),
    )
    if failed:
        raise MemoryError("the CPU linear kernel could not allocate its input buffer")
    return out


def dequantize_rows(spec: LinearSpec, rows: torch.Tensor) -> torch.Tensor:
    """float32 weight rows ``W[rows]`` [len(rows), in] (``rows`` int64, contiguous)."""
    if rows.numel() and not (0 <= int(rows.min()) and int(rows.max()) < spec.out):
        raise IndexError(f"rows out of range for a table of {spec.out} rows")
    out = torch.empty(rows.shape[0], spec.in_, dtype=torch.float32)
    _call("dequantize_rows_f32", spec, rows, rows.shape[0], out, torch.get_num_threads())
    return out


def packed_bytes(kind: int, out_features: int, in_features: int) -> int:
    """Bytes of a [out_features, in_features] layer packed as ``kind`` (LINEAR_Q4P/Q8P)."""
    name = {LINEAR_Q4P: "q4p_bytes", LINEAR_Q8P: "q8p_bytes"}[kind]
    return int(getattr(_library(), name)(out_features, in_features))


def pack(
    kind: int, values: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None
) -> torch.Tensor:
    """``kind``'s bytes of GGUF blocks, ``scale`` (and ``zero``) float16 [out, in / 32]:
    ``LINEAR_Q4P`` of ``values`` uint8 nibbles [out, in / 2] in GGUF's order (byte j of a
    32-block holds elements j and j + 16, low nibble first) and ``zero`` (Q4_0: ``-8 * scale``);
    ``LINEAR_Q8P`` of ``values`` int8 [out, in]."""
    q4 = kind == LINEAR_Q4P
    out_features, in_features = values.shape[0], values.shape[1] * (2 if q4 else 1)
    _check_blocks(values, torch.uint8 if q4 else torch.int8, scale, out_features, in_features)
    if q4:
        _check_blocks(zero, torch.float16, scale, out_features, in_features)
    packed = torch.empty(packed_bytes(kind, out_features, in_features), dtype=torch.uint8)
    blocks = [t.contiguous() for t in (values, scale, zero if q4 else None) if t is not None]
    _call(
        "q4p_pack" if q4 else "q8p_pack",
        *blocks,
        out_features,
        in_features,
        packed,
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


def read_probe(buffer: torch.Tensor, threads: int) -> int:
    """One pass of ``threads`` threads over a contiguous CPU tensor's bytes (csrc/probe.c): a
    read-bandwidth probe for the benchmarks' rooflines; returns the words' XOR fold."""
    if not (buffer.is_contiguous() and buffer.device.type == "cpu"):
        raise ValueError("read_probe reads a contiguous CPU tensor")
    return _call("read_probe", buffer, buffer.numel() * buffer.element_size(), threads)
