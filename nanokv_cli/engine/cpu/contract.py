"""The one definition of what the Python side and the C kernels (``csrc/``) agree on.

Every C function Python calls is declared here once, as C declares it (``ENTRY_POINTS``),
with the C view of a linear layer (``LINEAR_FIELDS``) and the recorded step's layout (which
kernels a step program replays, in which order, with how many arguments). From this table:

* ``header()`` generates ``contract.h``, written beside the sources at each build
  (``build.py``; it is part of the library's digest, so a changed table is a new library). It
  declares every entry point and the ``Linear`` and ``ProgramOp`` structs, numbers the
  replayed kernels and expands to ``run_program``'s dispatch (``csrc/program.c``): the C
  compiler checks each definition in ``csrc/*.c`` against its declaration here, so a C
  signature that drifts from the table does not build;
* ``signatures()`` gives ctypes its argument and result types, ``LinearSpec`` and
  ``ProgramOp`` are the structs' Python side, and ``program_kernels()`` the replayed kernels
  with the arguments each only writes;
* ``contract_id()`` (a digest of the header) is compiled in and exported
  (``nanokv_contract()``): a library is loaded only if it reports this process's id, so one
  built from another table is rebuilt, never called (``build._open``).

``python -m nanokv_cli.engine.cpu.contract`` prints the header.
"""

from __future__ import annotations

import ctypes
import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

HEADER_NAME = "contract.h"
CONTRACT_SYMBOL = "nanokv_contract"


@dataclass(frozen=True)
class EntryPoint:
    """One C function Python calls: its C declaration, whether a step program replays it,
    and the parameters it only writes (a program's own tensors where the step made them)."""

    declaration: str
    replayed: bool = False
    writes: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return _parse(self.declaration)[1]

    @property
    def returns(self) -> str:
        return _parse(self.declaration)[0]

    @property
    def params(self) -> tuple[tuple[str, str], ...]:
        """(C type, name) of each parameter."""
        return _parse(self.declaration)[2]

    def written(self) -> tuple[int, ...]:
        names = [name for _, name in self.params]
        return tuple(names.index(w) for w in self.writes)


def _replayed(declaration: str, writes: tuple[str, ...] = ()) -> EntryPoint:
    return EntryPoint(declaration, replayed=True, writes=writes)


# The replayed kernels first, in their program ids' order; then the rest.
ENTRY_POINTS: tuple[EntryPoint, ...] = (
    _replayed(
        "void rms_norm_f32(const float *x, int64_t x_stride, float *residual, "
        "int64_t residual_stride, const float *w, int64_t rows, int64_t inner, int64_t dim, "
        "float eps, float *out, int64_t out_stride, int threads)",
        writes=("out",),
    ),
    _replayed(
        "void rotary_f32(float *x, int64_t x_stride, int64_t n, int64_t heads, int64_t dim, "
        "const float *table, const int64_t *positions, int threads)"
    ),
    _replayed(
        "void store_kv_f32(const float *k, int64_t k_stride, const float *v, int64_t v_stride, "
        "const int64_t *slots, int64_t n, int64_t row, void *k_cache, void *v_cache, int half, "
        "int threads)"
    ),
    _replayed(
        "int paged_decode_f32(const float *q, int64_t q_stride, const void *k_cache, "
        "const void *v_cache, const int64_t *block_tables, const int64_t *context_lens, "
        "int64_t n, int64_t width, int64_t heads, int64_t kv_heads, int64_t dim, "
        "int64_t block_size, float scale, float *out, int64_t out_stride, int half, int threads)",
        writes=("out",),
    ),
    _replayed(
        "void silu_mul_f32(const float *x, int64_t n, int64_t inter, float *out, int threads)",
        writes=("out",),
    ),
    _replayed(
        "int linear_f32(const Linear *L, const float *x, int64_t x_stride, int64_t n, float *y, "
        "int64_t y_stride, int threads)",
        writes=("y",),
    ),
    EntryPoint("int cache_half_supported(void)"),
    EntryPoint(
        "void dequantize_rows_f32(const Linear *L, const int64_t *rows, int64_t n, float *out, "
        "int threads)"
    ),
    EntryPoint("int64_t q4p_bytes(int64_t out, int64_t in)"),
    EntryPoint(
        "void q4p_pack(const uint8_t *nibbles, const uint16_t *scale, const uint16_t *zero, "
        "int64_t out, int64_t in, uint8_t *packed, int threads)"
    ),
    EntryPoint("int64_t q8p_bytes(int64_t out, int64_t in)"),
    EntryPoint(
        "void q8p_pack(const int8_t *q, const uint16_t *scale, int64_t out, int64_t in, "
        "uint8_t *packed, int threads)"
    ),
    EntryPoint(
        "int run_program(const ProgramOp *ops, int64_t count, char *const *bases, "
        "const int64_t *scalars)"
    ),
    EntryPoint("uint64_t read_probe(const uint8_t *buf, int64_t bytes, int threads)"),
    EntryPoint(f"const char *{CONTRACT_SYMBOL}(void)"),
)

# A linear layer's weights as the kernels read them: LINEAR_F32 float32 [out][in] (linear.c),
# or one of the packed formats, one layout each for every row count: LINEAR_Q4P (q4.c) from
# Q4_0/Q4_1 blocks, LINEAR_Q8P (q8.c) from Q8_0 blocks.
LINEAR_KINDS = ("LINEAR_F32", "LINEAR_Q4P", "LINEAR_Q8P")
LINEAR_FIELDS = (
    ("int64_t", "kind"),
    ("int64_t", "out"),
    ("int64_t", "in"),
    ("const void *", "weight"),  # float32 [out][in], or the packed bytes
    ("const float *", "bias"),  # [out] or NULL
)
# The values a replay sets anew, in the order ``run_program``'s scalars hold them.
PROGRAM_SCALARS = ("threads", "rows", "width")
PROGRAM_FIXED = -1  # a ProgramOp base: the value itself


@cache
def _parse(declaration: str) -> tuple[str, str, tuple[tuple[str, str], ...]]:
    match = re.fullmatch(r"(.+?)\b(\w+)\((.*)\)", declaration.strip())
    if match is None:
        raise ValueError(f"not a C declaration: {declaration!r}")
    returns, name, params = match.groups()
    parsed = []
    for param in [] if params.strip() == "void" else params.split(","):
        c_type, param_name = re.fullmatch(r"(.+?)\s*\b(\w+)", param.strip()).groups()
        parsed.append((c_type.strip(), param_name))
    return returns.strip(), name, tuple(parsed)


class LinearSpec(ctypes.Structure):
    """A linear layer's weights as the C kernels read them (``LINEAR_FIELDS``). Pointers: the
    tensors must outlive the spec and stay in place; ``kernels.linear_spec`` keeps them on
    the spec (``tensors``), so a step program that calls it can hold them too."""

    _fields_ = [
        (name + "_" if name == "in" else name, ctypes.c_void_p if "*" in c_type else ctypes.c_int64)
        for c_type, name in LINEAR_FIELDS
    ]


_SCALAR_TYPES = {
    "int64_t": ctypes.c_int64,
    "uint64_t": ctypes.c_uint64,
    "int": ctypes.c_int,
    "float": ctypes.c_float,
}


def _ctype(c_type: str):
    if c_type == "void":
        return None
    if c_type == "const Linear *":
        return ctypes.POINTER(LinearSpec)
    if c_type == "const char *":
        return ctypes.c_char_p
    if "*" in c_type:
        return ctypes.c_void_p
    return _SCALAR_TYPES[c_type]


def signatures(entries: Sequence[EntryPoint] = ENTRY_POINTS) -> dict[str, tuple[list, object]]:
    """ctypes (argtypes, restype) of each entry point."""
    return {e.name: ([_ctype(t) for t, _ in e.params], _ctype(e.returns)) for e in entries}


def program_kernels(entries: Sequence[EntryPoint] = ENTRY_POINTS) -> dict[str, tuple[int, ...]]:
    """The kernels a step program replays, in id order, each with the arguments it only
    writes."""
    return {e.name: e.written() for e in entries if e.replayed}


def program_args(entries: Sequence[EntryPoint] = ENTRY_POINTS) -> int:
    """A ProgramOp's argument slots: the most any replayed kernel takes."""
    return max(len(e.params) for e in entries if e.replayed)


PROGRAM_ARGS = program_args()


class ProgramOp(ctypes.Structure):
    """One recorded call: argument i is ``value[i]`` where ``base[i] == PROGRAM_FIXED`` (a
    number, a float as its float32 bits, or a pointer into the model or the cache); the
    replay's scalar ``scalars[-2 - base[i]]`` (``PROGRAM_SCALARS``) times ``value[i]`` where
    ``base[i] <= -2``; else the address ``bases[base[i]] + value[i]`` (the step's arena, or
    one of its inputs)."""

    _fields_ = [
        ("kernel", ctypes.c_int64),
        ("base", ctypes.c_int64 * PROGRAM_ARGS),
        ("value", ctypes.c_int64 * PROGRAM_ARGS),
    ]


def _replay_call(entry: EntryPoint) -> str:
    """The C call ``run_program`` makes of a recorded op: P(i) a pointer, I(i) an integer,
    F(i) a float's bits (csrc/program.c)."""
    args = []
    for i, (c_type, _) in enumerate(entry.params):
        if "*" in c_type:
            args.append(f"P({i})")
        elif c_type == "float":
            args.append(f"F({i})")
        else:
            args.append(f"I({i})" if c_type == "int64_t" else f"({c_type})I({i})")
    call = f"{entry.name}({', '.join(args)})"
    return f"failed = {call}" if entry.returns == "int" else call


def _body(entries: Sequence[EntryPoint]) -> list[str]:
    replayed = [e for e in entries if e.replayed]
    lines = [f"enum {{ {', '.join(f'{k} = {i}' for i, k in enumerate(LINEAR_KINDS))} }};"]
    fields = " ".join(f"{t}{'' if t.endswith('*') else ' '}{n};" for t, n in LINEAR_FIELDS)
    lines += [f"typedef struct {{ {fields} }} Linear;", ""]
    lines += [
        f"#define PROGRAM_ARGS {program_args(entries)}",
        f"#define PROGRAM_FIXED ({PROGRAM_FIXED})",
        f"#define PROGRAM_SCALARS {len(PROGRAM_SCALARS)} /* {', '.join(PROGRAM_SCALARS)} */",
        "typedef struct { int64_t kernel, base[PROGRAM_ARGS], value[PROGRAM_ARGS]; } ProgramOp;",
        f"enum {{ {', '.join(f'PROGRAM_{e.name.upper()} = {i}' for i, e in enumerate(replayed))} }};",
        "",
    ]
    lines += [f"{e.declaration};" for e in entries]
    lines += ["", "/* run_program's cases: P, I, F and `failed` are its own (program.c) */"]
    lines.append("#define PROGRAM_DISPATCH \\")
    lines += [f"    case PROGRAM_{e.name.upper()}: {_replay_call(e)}; break; \\" for e in replayed]
    lines.append("    /* end */")
    return lines


def contract_id(entries: Sequence[EntryPoint] = ENTRY_POINTS) -> str:
    """The digest of the table's header: what a library built from it reports."""
    return hashlib.sha256("\n".join(_body(entries)).encode()).hexdigest()[:16]


def header(entries: Sequence[EntryPoint] = ENTRY_POINTS) -> str:
    """``contract.h`` for ``entries``: generated at each build, never edited."""
    return "\n".join(
        [
            "/* Generated from nanokv_cli/engine/cpu/contract.py at build time: do not edit. */",
            "#ifndef NANOKV_CONTRACT_H",
            "#define NANOKV_CONTRACT_H",
            "#include <stdint.h>",
            "",
            f'#define NANOKV_CONTRACT_ID "{contract_id(entries)}"',
            *_body(entries),
            "",
            "#endif",
            "",
        ]
    )


if __name__ == "__main__":
    print(header(), end="")
