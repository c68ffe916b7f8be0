"""Recorded decode steps: the kernel calls a torch forward makes, replayed in one C call.

A decode step is ~300 kernel calls (SmolLM2's 30 layers), each a few microseconds of Python and
ctypes around microseconds of arithmetic. As CUDA graphs do on the GPU, the runner records the
calls the torch forward makes for a step of n rows once (``recording``), and later steps of up
to n rows replay them in one C call (``StepProgram``, csrc/program.c): the torch model stays the
only description of the decoder. Which kernels replay, and their arguments, are
``contract.py``'s table.

What a replay cannot do, a recording refuses, loudly:

* a torch op that computes (an add, a copy, a matmul) would run while recording and vanish
  from every replay: inside ``recording()`` it raises ``RecordingError`` (``_ReplayGuard``).
  Allowed are what a replay needs no code for: views (slices, ``view``, and ``reshape`` /
  ``to`` / ``contiguous`` where they return a view of their input) and uninitialised
  allocations (``empty``, ``new_empty``: the program gives those tensors places in its arena,
  and refuses one a kernel reads before a kernel wrote it). Shapes, strides and
  ``data_ptr`` are no ops at all;
* a kernel the program cannot replay (``dequantize_rows``, ``pack``) raises at its call;
* the weights, the cache and the LinearSpec structs a program points at are held by it (their
  storages, and a private copy of each spec), so they cannot be freed under it; a pointed-at
  tensor moved since (``.data =``, ``set_``, a resize) makes the program stale, and ``run``
  raises ``StaleProgramError`` rather than read the old place.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import contract
from .contract import PROGRAM_FIXED as _FIXED
from .contract import LinearSpec, ProgramOp
from .library import library as _library

# Kernels a recorded step may call, in their program ids' order, with the arguments each only
# writes (its outputs): the step's own tensors are those an output makes.
_PROGRAM_KERNELS = contract.program_kernels()
_KERNEL_IDS = {name: i for i, name in enumerate(_PROGRAM_KERNELS)}


class RecordingError(RuntimeError):
    """Something ran inside ``recording()`` that a replay of the step would not do."""


class StaleProgramError(RuntimeError):
    """A tensor a step program points at has moved since it was recorded: record anew."""


# The calls made inside ``recording()``: context-local, like torch's grad mode, so a recording
# holds exactly the calls of its own ``with`` block on its own thread.
_TAPE: ContextVar[list | None] = ContextVar("nanokv_cpu_tape", default=None)


class _Scalar(int):
    """An argument a replay sets anew: ``scalars[slot] * per`` (see ProgramOp)."""

    slot = contract.PROGRAM_SCALARS.index("threads")

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

    slot = contract.PROGRAM_SCALARS.index("rows")


class _Width(_Scalar):
    """The block tables' width."""

    slot = contract.PROGRAM_SCALARS.index("width")


def _call(name: str, *args):
    """C function ``name`` on ``args``, tensors passed as their data pointers; recorded too
    inside ``recording()``, where a kernel no program replays is refused."""
    tape = _TAPE.get()
    if tape is not None:
        if name not in _KERNEL_IDS:
            raise RecordingError(
                f"{name} ran inside a recorded step, and no step program replays it"
            )
        tape.append((name, args))
    return getattr(_library(), name)(
        *(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)
    )


_aten = torch.ops.aten
# Allocations without contents: a replay places such tensors in its arena.
_ALLOCATIONS = frozenset(
    {
        _aten.empty.memory_format,
        _aten.empty_strided.default,
        _aten.empty_like.default,
        _aten.new_empty.default,
        _aten.new_empty_strided.default,
    }
)


class _ReplayGuard(TorchDispatchMode):
    """Active inside ``recording()``: every torch op that reaches ATen passes through here, and
    any that computes raises, since a replay runs only the kernel calls."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Otherwise torch wraps __torch_dispatch__ to keep torch.compile out of it, which
        # imports torch._dynamo (and sympy) on the first recording: 1.1-1.3 s more to a
        # process's first decode step, measured. Nothing here is ever compiled.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        allocation = func in _ALLOCATIONS
        if not allocation and not (func.is_view and not func._schema.is_mutable):
            raise RecordingError(_refusal(func, "computes"))
        out = func(*args, **kwargs)
        # reshape and to are views when they can be, copies otherwise (their copy runs
        # beneath this mode): only the view passes.
        if not allocation and not _aliases(out, args):
            raise RecordingError(_refusal(func, "copied its input"))
        return out


def _aliases(out, args) -> bool:
    source = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if source is None:
        return False
    outs = out if isinstance(out, (tuple, list)) else (out,)
    at = source.untyped_storage().data_ptr()
    return all(o.untyped_storage().data_ptr() == at for o in outs if isinstance(o, torch.Tensor))


def _refusal(func, what: str) -> str:
    return (
        f"torch op {func} {what} inside a recorded decode step: a replay runs only the C kernel "
        "calls (cpu/kernels.py), so its result would be missing from every replayed step. "
        "Compute it with a kernel, or outside the recorded block"
    )


@contextmanager
def recording() -> Iterator[list]:
    """Record the kernel calls made inside the block (they also run) for ``StepProgram``;
    a torch op that computes, or a kernel no program replays, raises ``RecordingError``."""
    tape: list = []
    token = _TAPE.set(tape)
    try:
        with _ReplayGuard():
            yield tape
    finally:
        _TAPE.reset(token)


class StepProgram:
    """A recorded step of n rows, replayed by one C call on the inputs of a step of up to n.

    ``inputs``: the tensors the step reads that change from step to step (embeddings, positions,
    slots, block tables, context lengths). ``persistent``: storage addresses that outlive the
    program (weights, the KV cache): the program holds each such tensor it points at (and its
    storage), and a copy of each LinearSpec with its tensors. Every other tensor the calls touch
    was made during the step: it gets a place in one arena, shared with the tensors whose
    lifetimes do not overlap its own, and ``output`` is read from there after a replay. Row
    counts, the tables' width and the thread count are the replay's (``_Scalar``): every tensor
    the step makes is rows of a fixed width, so a step of fewer rows uses the first of them.
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
        lives = _lives(tape, self.rows, inputs_at, persistent)
        out_key = output.untyped_storage().data_ptr()
        if out_key not in lives:
            raise ValueError("the step's output was not written by a recorded kernel")
        lives[out_key][1] = len(tape)
        offsets, self.arena_bytes = _plan(lives)
        self._pin(tape, inputs_at, offsets)
        self.ops = (ProgramOp * len(tape))()
        for op, (name, args) in zip(self.ops, tape):
            op.kernel = _KERNEL_IDS[name]
            for j, a in enumerate(args):
                op.base[j], op.value[j] = _encode(a, inputs_at, offsets, self._spec_at)
        self.output = (offsets[out_key] + output.data_ptr() - out_key, output.dtype, output.shape)

    def _pin(self, tape: list, inputs_at: dict, offsets: dict[int, int]) -> None:
        """Hold what the ops point at outside the step: the tensors they are given fixed (and
        their storages, which outlive a tensor moved elsewhere), and a private copy of each
        LinearSpec with the tensors it points at, for ``run`` to check none has moved."""
        tensors: dict[int, torch.Tensor] = {}
        specs: dict[int, LinearSpec] = {}
        for _, args in tape:
            for a in args:
                if isinstance(a, LinearSpec):
                    specs.setdefault(id(a), a)
                    for t in _spec_tensors(a):
                        tensors.setdefault(id(t), t)
                elif isinstance(a, torch.Tensor):
                    key = a.untyped_storage().data_ptr()
                    if key not in inputs_at and key not in offsets:
                        tensors.setdefault(id(a), a)
        self._specs = (LinearSpec * max(1, len(specs)))(*specs.values())
        base, size = ctypes.addressof(self._specs), ctypes.sizeof(LinearSpec)
        self._spec_at = {key: base + i * size for i, key in enumerate(specs)}
        self._pinned = tuple(tensors.values())
        self._storages = tuple(t.untyped_storage() for t in self._pinned)
        self._pinned_at = [t.data_ptr() for t in self._pinned]

    def run(
        self, arena: torch.Tensor, inputs: Sequence[torch.Tensor], rows: int, width: int
    ) -> torch.Tensor:
        """Replay on the ``inputs`` (as recorded, contiguous) of a step of ``rows`` rows whose
        block tables are ``width`` wide, in ``arena`` (at least ``arena_bytes``); the output is
        a view of the arena. ``StaleProgramError`` if a tensor it points at has moved."""
        if not 0 < rows <= self.rows or arena.nbytes < self.arena_bytes:
            raise ValueError(f"a step program of {self.rows} rows cannot replay {rows}")
        if list(map(torch.Tensor.data_ptr, self._pinned)) != self._pinned_at:
            raise StaleProgramError(self._moved())
        bases = (ctypes.c_void_p * (1 + len(inputs)))(
            arena.data_ptr(), *(t.data_ptr() for t in inputs)
        )
        scalars = (ctypes.c_int64 * len(contract.PROGRAM_SCALARS))(
            torch.get_num_threads(), rows, width
        )
        if _library().run_program(self.ops, len(self.ops), bases, scalars):
            raise MemoryError("a CPU kernel of the replayed step could not allocate its buffers")
        offset, dtype, shape = self.output
        whole = arena[offset : offset + shape.numel() * dtype.itemsize].view(dtype).view(shape)
        return whole[:rows]

    def _moved(self) -> str:
        moved = [
            t for t, at in zip(self._pinned, self._pinned_at, strict=True) if t.data_ptr() != at
        ]
        t = moved[0]
        return (
            f"{len(moved)} tensor(s) the step program points at moved since it was recorded "
            f"(a {tuple(t.shape)} {t.dtype}, now at {t.data_ptr():#x}): record the step anew"
        )


def _lives(tape: list, rows: int, inputs_at: dict, persistent: set[int]) -> dict[int, list[int]]:
    """Each tensor the step makes (not an input, not persistent): [first op, last op, bytes]."""
    lives: dict[int, list[int]] = {}
    for i, (name, args) in enumerate(tape):
        if name not in _PROGRAM_KERNELS:
            raise ValueError(f"{name} cannot be replayed")
        for j, a in enumerate(args):
            if isinstance(a, _Rows) and a != rows * a.per:
                raise ValueError(f"a kernel of the step ran on {a // a.per} of its {rows} rows")
            if not isinstance(a, torch.Tensor):
                continue
            key = a.untyped_storage().data_ptr()
            if key in persistent or key in inputs_at:
                continue
            if key not in lives and j not in _PROGRAM_KERNELS[name]:
                # its contents would be whatever the arena held
                raise ValueError(f"{name} reads a tensor the step neither made nor was given")
            # a tensor freed during the step may lend its address to a larger one: one life
            # spans both, as large as the largest
            life = lives.setdefault(key, [i, i, 0])
            life[1:] = i, max(life[2], a.untyped_storage().nbytes())
    return lives


def _spec_tensors(spec: LinearSpec) -> tuple[torch.Tensor, ...]:
    """The tensors ``spec`` points at, as ``kernels.linear_spec`` kept them; a spec without
    them, or no longer pointing at them, cannot be held by a program."""
    tensors = getattr(spec, "tensors", None)
    if tensors is None:
        raise ValueError("a recorded LinearSpec must come from kernels.linear_spec (its tensors)")
    weight, bias = tensors
    if spec.weight != weight.data_ptr() or (spec.bias or 0) != (
        0 if bias is None else bias.data_ptr()
    ):
        raise ValueError("a recorded LinearSpec no longer points at its tensors")
    return tuple(t for t in tensors if t is not None)


def _encode(a, inputs_at: dict, offsets: dict[int, int], spec_at: dict) -> tuple[int, int]:
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
    if isinstance(a, LinearSpec):
        return _FIXED, spec_at[id(a)]
    if isinstance(a, ctypes.Structure):
        raise ValueError(f"a recorded step cannot hold a {type(a).__name__}")
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
