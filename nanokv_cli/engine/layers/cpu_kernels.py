"""Python side of nanokv's CPU kernels (``cpu_kernels.c``), built on first use with the system
C compiler and called through ctypes.

Why leave PyTorch on the CPU:

* Paged decode attention. The torch path gathers every decoding sequence's K/V out of the paged
  cache into a contiguous buffer, then runs SDPA, whose CPU kernel is slow for 1-token queries.
  The kernel reads K and V where they lie, through the block table, each cache row once for all
  the query heads that share it (GQA), a chunk of rows ahead, accumulating in float32.
* Per-op overhead. A single sequence's decode step is ~30 layers of tiny tensors, where each
  torch op costs microseconds of dispatch. Fused here: residual add + RMSNorm, rotary in place,
  the K/V store, silu(gate) * up; and ``decode_step`` runs a whole decoder for a step of a few
  single-token rows in one call (~10 ms less Python per SmolLM2 step).
* Quantized weights. ``linear`` multiplies GGUF-format int8/int4 weights (Q8_0, Q4_0/Q4_1
  blocks) by inputs rounded to int8 per 32 values, with integer multiply-adds; see
  ``layers/quant.py``. Float32 weights go through the same entry point for ``decode_step``,
  and so do the copies ``--quantization auto`` uses for batches, tiled GEMMs with assembly
  tiles blocked for L1/L2: fixed point for prefills (``pack_i16``: 14-bit weights against
  inputs rounded to 13 bits per 64 values, 16 products per instruction;
  ``quant.FixedPointLinear``) and int4 blocks unpacked into panels for decode steps
  (``pack_q4_panels``: the same int8-rounded inputs as the blocks' row kernel, 32 products
  per instruction; ``quant.PanelInt4Linear``).
* A float16 KV cache (``auto``, CPUs with F16C): the store rounds K/V to float16 and the
  attention kernel converts them back as it reads, halving a decode step's cache traffic.

The kernels are vectorised with AVX2/FMA/F16C where the CPU has them (plain C elsewhere) and run
on torch's OpenMP thread pool (the library links the same libgomp). They are compiled with
``-ffp-contract=off`` so that element-wise results round as torch's separate ops do; attention,
matrix-vector products and the norm's sum of squares differ from torch's in summation order.

The library is built once per source version and CPU into nanokv's cache directory (a few
seconds). Without a compiler, or with ``NANOKV_CPU_KERNELS=0``, ``available()`` is False: every
caller stays on its torch path and quantization is unavailable.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

_SOURCE_FILE = Path(__file__).with_name("cpu_kernels.c")

# Tried in order: the first that compiles wins. -march=native is safe because the library is
# cached per CPU (see _library_path); without OpenMP the kernels run on one thread.
_FLAG_SETS = (
    ["-O3", "-march=native", "-fopenmp"],
    ["-O3", "-fopenmp"],
    ["-O3", "-march=native"],
    ["-O3"],
)
# No FMA contraction (element-wise results round as torch's separate ops do); no errno or
# trap semantics, which only block vectorisation (neither changes a result).
_COMMON_FLAGS = ["-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-shared", "-fPIC"]
_ENV_SWITCH = "NANOKV_CPU_KERNELS"

_i64, _ptr, _f32, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int

# Weight storage kinds of the C ``Linear`` (see cpu_kernels.c).
LINEAR_F32, LINEAR_Q8, LINEAR_Q4, LINEAR_Q8_FLOAT_INPUT, LINEAR_I16, LINEAR_Q4_PANELS = range(6)
# LINEAR_I16 rounds inputs per this many values; the input size must be a multiple of it.
I16_BLOCK = 64


class LinearSpec(ctypes.Structure):
    """A linear layer's weights as the C kernels read them (pointers: the tensors must outlive
    the spec and stay in place)."""

    _fields_ = [
        ("kind", _i64),
        ("out", _i64),
        ("in_", _i64),
        ("weight", _ptr),
        ("scale", _ptr),
        ("zero", _ptr),
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
    "linear_f32": ([ctypes.POINTER(LinearSpec), _ptr, _i64, _i64, _ptr, _i64, _int], _int),
    "dequantize_rows_f32": ([ctypes.POINTER(LinearSpec), _ptr, _i64, _ptr, _int], None),
    "i16_packed_ints": ([_i64, _i64], _i64),
    "pack_i16": ([_ptr, _i64, _i64, _ptr, _ptr, _int], _int),
    "q4_panel_bytes": ([_i64, _i64], _i64),
    "pack_q4_panels": ([ctypes.POINTER(LinearSpec), _ptr, _int], None),
    "decode_step_f32": (
        [ctypes.POINTER(DecoderSpec), _ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _int],
        _int,
    ),
}


def available() -> bool:
    """Whether the kernels can run here (built, or buildable now)."""
    return _library() is not None


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
    scale: torch.Tensor | None = None,
    zero: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_features: int | None = None,
) -> LinearSpec:
    """The C view of a linear layer: ``weight`` float32 [out, in], int8 [out, in] or packed 4-bit
    uint8 [out, in / 2]; ``scale``/``zero`` float16 [out, in / 32]; ``bias`` float32 [out]. For
    ``LINEAR_I16``, ``weight`` and ``scale`` as ``pack_i16`` returns them, and ``out_features``."""
    for t in (weight, scale, zero, bias):
        if t is not None and not t.is_contiguous():
            raise ValueError("linear_spec needs contiguous tensors")
    return LinearSpec(
        kind,
        weight.shape[0] if out_features is None else out_features,
        in_features,
        weight.data_ptr(),
        None if scale is None else scale.data_ptr(),
        None if zero is None else zero.data_ptr(),
        None if bias is None else bias.data_ptr(),
    )


def linear(spec: LinearSpec, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T + b`` for float32 rows ``x`` [n, in] (row stride free, columns packed)."""
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
        torch.get_num_threads(),
    )
    if failed:
        raise MemoryError("the CPU linear kernel could not allocate its input buffer")
    return out


def pack_i16(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float32 weight [out, in] as ``LINEAR_I16`` reads it: 14-bit integers per output row in
    panels of 16 rows (int32 pairs), and float32 row scales (padded to a multiple of 16)."""
    out_features, in_features = weight.shape
    if in_features % I16_BLOCK:
        raise ValueError(f"input size {in_features} is not a multiple of {I16_BLOCK}")
    lib = _library()
    w = weight.detach().float().contiguous()
    packed = torch.empty(lib.i16_packed_ints(out_features, in_features), dtype=torch.int32)
    scale = torch.zeros((out_features + 15) // 16 * 16, dtype=torch.float32)
    lib.pack_i16(
        w.data_ptr(),
        out_features,
        in_features,
        packed.data_ptr(),
        scale.data_ptr(),
        torch.get_num_threads(),
    )
    return packed, scale


def pack_q4_panels(spec: LinearSpec) -> torch.Tensor:
    """A ``LINEAR_Q4`` layer's blocks as ``LINEAR_Q4_PANELS`` reads them: one byte per weight in
    panels of 16 outputs, with float32 scales and zeros (see cpu_kernels.c)."""
    if spec.kind != LINEAR_Q4:
        raise ValueError("pack_q4_panels takes a LINEAR_Q4 layer")
    lib = _library()
    packed = torch.empty(lib.q4_panel_bytes(spec.out, spec.in_), dtype=torch.uint8)
    lib.pack_q4_panels(ctypes.byref(spec), packed.data_ptr(), torch.get_num_threads())
    return packed


def dequantize_rows(spec: LinearSpec, rows: torch.Tensor) -> torch.Tensor:
    """float32 weight rows ``W[rows]`` [len(rows), in] (``rows`` int64, contiguous)."""
    out = torch.empty(rows.shape[0], spec.in_, dtype=torch.float32)
    _library().dequantize_rows_f32(
        ctypes.byref(spec), rows.data_ptr(), rows.shape[0], out.data_ptr(), torch.get_num_threads()
    )
    return out


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
    if os.environ.get(_ENV_SWITCH, "1") == "0":
        return None
    try:
        path = _library_path()
        if not path.is_file():
            _build(path)
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError):
        return None  # no compiler or no writable cache: the torch paths serve
    for name, (argtypes, restype) in _SIGNATURES.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, restype
    return lib


def _library_path() -> Path:
    from ..loader import default_cache_dir

    # One build per source version and CPU: -march=native code must not meet another CPU.
    identity = "\n".join(
        [
            _SOURCE_FILE.read_text(),
            platform.machine(),
            _cpu_flags(),
            repr(_FLAG_SETS + (_COMMON_FLAGS,)),
        ]
    )
    key = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return default_cache_dir() / "kernels" / f"cpu_kernels-{key}.so"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _build(path: Path) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        built = Path(tmp) / path.name
        for flags in _FLAG_SETS:
            command = [compiler, *flags, *_COMMON_FLAGS, "-o", str(built), str(_SOURCE_FILE), "-lm"]
            if subprocess.run(command, capture_output=True, timeout=120).returncode == 0:
                os.replace(built, path)  # atomic: a concurrent build just wins or loses
                return
    raise RuntimeError("the C compiler rejected nanokv's CPU kernels")
