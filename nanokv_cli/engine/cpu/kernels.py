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
  the torch layers made on an earlier step of as many rows or more (``StepProgram``: ~10 ms
  less Python per SmolLM2 step).
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

The library is built once per source version, compiler and CPU into nanokv's cache directory (a
few seconds; ``build.py``). Without a compiler, or with ``NANOKV_CPU_KERNELS=0``, ``available()``
is False and ``status().missing`` says why: every caller stays on its torch path and
quantization is unavailable.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
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
    "store_kv_f32": ([_ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, _ptr, _ptr, _int, _int], None),
    "cache_half_supported": ([], _int),
    "silu_mul_f32": ([_ptr, _i64, _i64, _ptr, _int], None),
    "linear_f32": ([ctypes.POINTER(LinearSpec), _ptr, _i64, _i64, _ptr, _i64, _int], _int),
    "dequantize_rows_f32": ([ctypes.POINTER(LinearSpec), _ptr, _i64, _ptr, _int], None),
    "q4p_bytes": ([_i64, _i64], _i64),
    "q4p_pack": ([_ptr, _ptr, _ptr, _i64, _i64, _ptr, _int], None),
    "q8p_bytes": ([_i64, _i64], _i64),
    "q8p_pack": ([_ptr, _ptr, _i64, _i64, _ptr, _int], None),
    "run_program": ([_ptr, _i64, _ptr, _ptr], _int),
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
    return LinearSpec(
        kind,
        weight.shape[0] if out_features is None else out_features,
        in_features,
        weight.data_ptr(),
        None if bias is None else bias.data_ptr(),
    )


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
    _library().dequantize_rows_f32(
        ctypes.byref(spec), rows.data_ptr(), rows.shape[0], out.data_ptr(), torch.get_num_threads()
    )
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
    getattr(_library(), "q4p_pack" if q4 else "q8p_pack")(
        *(t.data_ptr() for t in blocks),
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


# -- recorded steps ----------------------------------------------------------------------------
#
# A decode step is ~300 kernel calls (SmolLM2's 30 layers), each a few microseconds of Python and
# ctypes around microseconds of arithmetic. As CUDA graphs do on the GPU, the runner records the
# calls the torch forward makes for a step of n rows once, and later steps of up to n rows replay
# them in one C call (csrc/program.c): the torch model stays the only description of the decoder.

# Kernels a recorded step may call, in csrc/program.c's order, with the arguments each only
# writes (its outputs): the step's own tensors are those an output makes.
_PROGRAM_KERNELS = {
    "rms_norm_f32": (9,),
    "rotary_f32": (),
    "store_kv_f32": (),
    "paged_decode_f32": (13,),
    "silu_mul_f32": (3,),
    "linear_f32": (4,),
}
_PROGRAM_ARGS = 17  # the most any of them takes
_FIXED = -1  # a ProgramOp base: the value itself


class ProgramOp(ctypes.Structure):
    """One recorded call: argument i is ``value[i]`` where ``base[i] == _FIXED`` (a number, a
    float as its float32 bits, or a pointer into the model or the cache); the replay's scalar
    ``scalars[-2 - base[i]]`` (threads, rows, table width) times ``value[i]`` where
    ``base[i] <= -2``; else the address ``bases[base[i]] + value[i]`` (the step's arena, or one
    of its inputs)."""

    _fields_ = [
        ("kernel", _i64),
        ("base", _i64 * _PROGRAM_ARGS),
        ("value", _i64 * _PROGRAM_ARGS),
    ]


# The calls made inside ``recording()``: context-local, like torch's grad mode, so a recording
# holds exactly the calls of its own ``with`` block on its own thread.
_TAPE: ContextVar[list | None] = ContextVar("nanokv_cpu_tape", default=None)


class _Scalar(int):
    """An argument a replay sets anew: ``scalars[slot] * per`` (see ProgramOp)."""

    slot = 0

    def __new__(cls, value: int, per: int = 1) -> _Scalar:
        self = super().__new__(cls, value * per)
        self.per = per
        return self


class _Threads(_Scalar):
    """The kernels' thread count, ``torch.get_num_threads()`` at each call."""

    def __new__(cls) -> _Threads:
        return super().__new__(cls, torch.get_num_threads())


class _Rows(_Scalar):
    """A row count: the step's tokens, times ``per`` (heads, for per-head norms)."""

    slot = 1


class _Width(_Scalar):
    """The block tables' width."""

    slot = 2


def _call(name: str, *args):
    """C function ``name`` on ``args``, tensors passed as their data pointers; recorded too
    inside ``recording()``."""
    tape = _TAPE.get()
    if tape is not None:
        tape.append((name, args))
    return getattr(_library(), name)(
        *(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)
    )


@contextmanager
def recording() -> Iterator[list]:
    """Record the kernel calls made inside the block (they also run) for ``StepProgram``."""
    tape: list = []
    token = _TAPE.set(tape)
    try:
        yield tape
    finally:
        _TAPE.reset(token)


class StepProgram:
    """A recorded step of n rows, replayed by one C call on the inputs of a step of up to n.

    ``inputs``: the tensors the step reads that change from step to step (embeddings, positions,
    slots, block tables, context lengths). ``persistent``: storage addresses that outlive the
    program (weights, the KV cache). Every other tensor the calls touch was made during the
    step: it gets a place in one arena, shared with the tensors whose lifetimes do not overlap
    its own, and ``output`` is read from there after a replay. Row counts, the tables' width
    and the thread count are the replay's (``_Scalar``): every tensor the step makes is rows
    of a fixed width, so a step of fewer rows uses the first of them.
    """

    def __init__(
        self,
        tape: list,
        inputs: Sequence[torch.Tensor],
        output: torch.Tensor,
        persistent: set[int],
    ) -> None:
        inputs_at = {t.untyped_storage().data_ptr(): (i, t) for i, t in enumerate(inputs)}
        self.rows = output.shape[0]
        lives: dict[int, list[int]] = {}  # arena tensor storage -> [first op, last op, bytes]
        for i, (name, args) in enumerate(tape):
            for j, a in enumerate(args):
                if isinstance(a, _Rows) and a != self.rows * a.per:
                    raise ValueError(f"a kernel of the step ran on {a // a.per} of its {self.rows} rows")
                if isinstance(a, torch.Tensor):
                    key = a.untyped_storage().data_ptr()
                    if key not in persistent and key not in inputs_at:
                        if key not in lives and j not in _PROGRAM_KERNELS.get(name, ()):
                            # its contents would be whatever the arena held
                            raise ValueError(
                                f"{name} reads a tensor the step neither made nor was given"
                            )
                        # a tensor freed during the step may lend its address to a larger
                        # one: one life spans both, as large as the largest
                        life = lives.setdefault(key, [i, i, 0])
                        life[1:] = i, max(life[2], a.untyped_storage().nbytes())
        out_key = output.untyped_storage().data_ptr()
        if out_key not in lives:
            raise ValueError("the step's output was not written by a recorded kernel")
        lives[out_key][1] = len(tape)
        offsets, self.arena_bytes = _plan(lives)
        self.ops = (ProgramOp * len(tape))()
        for op, (name, args) in zip(self.ops, tape):
            if name not in _PROGRAM_KERNELS:
                raise ValueError(f"{name} cannot be replayed")
            op.kernel = list(_PROGRAM_KERNELS).index(name)
            for j, a in enumerate(args):
                op.base[j], op.value[j] = _encode(a, inputs_at, offsets)
        self.output = (offsets[out_key] + output.data_ptr() - out_key, output.dtype, output.shape)

    def run(
        self, arena: torch.Tensor, inputs: Sequence[torch.Tensor], rows: int, width: int
    ) -> torch.Tensor:
        """Replay on the ``inputs`` (as recorded, contiguous) of a step of ``rows`` rows whose
        block tables are ``width`` wide, in ``arena`` (at least ``arena_bytes``); the output is
        a view of the arena."""
        if not 0 < rows <= self.rows or arena.nbytes < self.arena_bytes:
            raise ValueError(f"a step program of {self.rows} rows cannot replay {rows}")
        bases = (ctypes.c_void_p * (1 + len(inputs)))(
            arena.data_ptr(), *(t.data_ptr() for t in inputs)
        )
        scalars = (ctypes.c_int64 * 3)(torch.get_num_threads(), rows, width)
        if _library().run_program(self.ops, len(self.ops), bases, scalars):
            raise MemoryError("a CPU kernel of the replayed step could not allocate its buffers")
        offset, dtype, shape = self.output
        whole = arena[offset : offset + shape.numel() * dtype.itemsize].view(dtype).view(shape)
        return whole[:rows]


def _encode(a, inputs_at: dict, offsets: dict[int, int]) -> tuple[int, int]:
    """A recorded argument as (base, value) (see ProgramOp): an input (base 1 + i), an arena
    tensor (base 0), else fixed."""
    if isinstance(a, _Scalar):
        return -2 - a.slot, a.per
    if isinstance(a, torch.Tensor):
        key = a.untyped_storage().data_ptr()
        if key in inputs_at:
            i, t = inputs_at[key]
            return 1 + i, a.data_ptr() - t.data_ptr()
        if key in offsets:
            return 0, offsets[key] + a.data_ptr() - key
        return _FIXED, a.data_ptr()
    if isinstance(a, float):
        return _FIXED, int.from_bytes(struct.pack("<f", a), "little", signed=True)
    if isinstance(a, ctypes.Structure):
        return _FIXED, ctypes.addressof(a)
    return _FIXED, 0 if a is None else int(a)


def _plan(lives: dict[int, list[int]]) -> tuple[dict[int, int], int]:
    """Arena offsets (64-byte aligned) for tensors live from op first to op last: in order of
    first use, each at the lowest offset that overlaps no tensor still live."""
    offsets: dict[int, int] = {}
    live: list[tuple[int, int, int]] = []  # (offset, end, last op)
    size_needed = 0
    for key, (first, last, size) in sorted(lives.items(), key=lambda kv: kv[1][0]):
        size = (size + 63) // 64 * 64
        live = sorted(p for p in live if p[2] >= first)
        offset = 0
        for o, e, _ in live:
            if offset + size <= o:
                break
            offset = max(offset, e)
        offsets[key] = offset
        live.append((offset, offset + size, last))
        size_needed = max(size_needed, offset + size)
    return offsets, size_needed


def status() -> build.Kernels:
    """How the kernels load here: the variant, the library file, or why they are unavailable
    (``missing``: what, what it costs, how to fix it). Asked afresh (cheap once built); the
    layers use the answer ``_library`` kept."""
    return build.kernels(tuple(_SIGNATURES))


@cache
def _library() -> ctypes.CDLL | None:
    lib = status().lib
    if lib is None:
        return None  # switched off, or no compiler: the torch paths serve
    for name, (argtypes, restype) in _SIGNATURES.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, restype
    return lib
