"""Building and loading the CPU kernels (``csrc/*.c``): one shared library per instruction set.

The kernels are compiled with the system C compiler on first use into nanokv's cache
directory and called through ctypes. Which variant runs is decided at run time from what this
CPU reports (``/proc/cpuinfo``), not from the machine that built it, so a cache directory
shared between an AVX2-only EPYC and an AVX-512 Xeon holds one library for each and neither
meets the other's code.

A library's file name is a digest of everything that decides its code: the sources, the
header generated from ``contract.py`` (written beside them at each build), the compiler (its
path and ``--version``), the flags and the CPU features the variant uses. A library is used
only after it loads, exports every kernel the caller needs and reports the contract this
process was given (``contract.contract_id``); a cached file that does not (an empty or
truncated build, an older nanokv's, one built from another table) is rebuilt, never trusted.

``NANOKV_CPU_ISA`` forces a variant (``generic``, ``avx2``, ``avx512``, any case): that is how
the test suite runs the plain-C and AVX2 paths on an AVX-512 machine. Asking for a variant this
CPU cannot run, or one that does not exist, is an error naming the valid ones, not a silent
fallback. ``NANOKV_CPU_KERNELS=0`` (or false, off, no) switches the kernels off. Without a compiler the kernels are
unavailable: ``kernels(...).missing`` says why, what it costs and how to fix it, and every
caller stays on torch (and quantized formats are unavailable).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from . import contract

SOURCE_DIR = Path(__file__).with_name("csrc")
ISA_VARIABLE = "NANOKV_CPU_ISA"
SWITCH_VARIABLE = "NANOKV_CPU_KERNELS"
# What running without the kernels costs (SmolLM2-135M, one sequence: scripts/BENCHMARKS.md).
TORCH_PATH_COST = (
    "decoding runs about 8x slower on torch's kernels, with float32 weights (10x the memory)"
)


@dataclass(frozen=True)
class IsaVariant:
    """One build of the kernels: the compiler flags that enable an instruction set, and the
    CPU features (as /proc/cpuinfo names them) a machine needs to run it."""

    name: str
    flags: tuple[str, ...]
    requires: frozenset[str]


# Best first. x86-64-v3 is AVX2 + FMA + F16C + BMI2 (every AVX2 machine nanokv meets);
# x86-64-v4 adds AVX-512 F/BW/CD/DQ/VL, and VNNI is the integer dot product the quantized
# kernels use where it exists.
VARIANTS: tuple[IsaVariant, ...] = (
    IsaVariant(
        "avx512",
        ("-march=x86-64-v4", "-mavx512vnni"),
        frozenset(
            {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}
        ),
    ),
    IsaVariant("avx2", ("-march=x86-64-v3",), frozenset({"avx2", "fma", "f16c", "bmi2"})),
    IsaVariant("generic", (), frozenset()),
)
VARIANT_NAMES = tuple(v.name for v in VARIANTS)
# No FMA contraction (element-wise results round as torch's separate ops do); no errno or
# trap semantics, which only block vectorisation (neither changes a result).
_COMMON_FLAGS = (
    "-O3",
    "-ffp-contract=off",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fopenmp-simd",  # the `omp simd` loop hints only: threads are csrc/pool.c's, not OpenMP's
    "-pthread",
    "-shared",
    "-fPIC",
)


class KernelBuildError(RuntimeError):
    """The kernels could not be built or loaded as asked."""


class KernelVariantError(KernelBuildError, ValueError):
    """``NANOKV_CPU_ISA`` names a variant that does not exist or that this CPU cannot run: the
    user's setting to fix (a ValueError, so the CLI prints it as one line)."""


@dataclass(frozen=True)
class Kernels:
    """The outcome of loading the kernels in this process."""

    lib: ctypes.CDLL | None  # None: callers stay on torch
    variant: IsaVariant
    path: Path | None  # the library file (None where none was found or built)
    built: bool  # compiled by this process (else taken from the cache)
    missing: str | None  # why ``lib`` is None: what is missing, what it costs, how to fix it
    switched_off: bool = False  # NANOKV_CPU_KERNELS=0: asked for, so no note


def cpu_features() -> frozenset[str]:
    """The instruction-set features this CPU reports (empty where /proc/cpuinfo is missing)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def usable_variants(features: frozenset[str]) -> list[IsaVariant]:
    """The variants this CPU can run, best first (``generic`` always)."""
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    return [v for v in VARIANTS if v.name == "generic" or (x86 and v.requires <= features)]


def choose_variant(features: frozenset[str], forced: str | None = None) -> IsaVariant:
    """The variant to run: ``forced`` (a name, any case) if this CPU can run it, else the best
    it can."""
    usable = usable_variants(features)
    name = (forced or "").strip().lower()
    if not name:
        return usable[0]
    runs = ", ".join(v.name for v in usable)
    if name not in VARIANT_NAMES:
        raise KernelVariantError(
            f"{ISA_VARIABLE}={forced!r}: choose one of {', '.join(VARIANT_NAMES)} "
            f"(this CPU runs {runs}), or unset it for the best"
        )
    for variant in usable:
        if variant.name == name:
            return variant
    missing = sorted(next(v for v in VARIANTS if v.name == name).requires - features)
    raise KernelVariantError(
        f"{ISA_VARIABLE}={forced}: this CPU lacks {', '.join(missing)}; it can run {runs}"
    )


# NANOKV_CPU_KERNELS's spellings, any case; unset or empty means on.
_SWITCH_OFF = ("0", "false", "off", "no")
_SWITCH_ON = ("", "1", "true", "on", "yes")


def switched_off() -> bool:
    """Whether ``NANOKV_CPU_KERNELS`` switches the kernels off; a value that is neither an off
    nor an on spelling raises KernelVariantError (a typo must not leave them on silently)."""
    value = os.environ.get(SWITCH_VARIABLE, "")
    word = value.strip().lower()
    if word in _SWITCH_OFF:
        return True
    if word in _SWITCH_ON:
        return False
    raise KernelVariantError(
        f"{SWITCH_VARIABLE}={value[:40]!r}: set it to {'/'.join(_SWITCH_OFF)} to switch the "
        f"kernels off, or {'/'.join(_SWITCH_ON[1:])} (or unset it) to run them"
    )


def active_variant() -> IsaVariant:
    """The variant this process runs (``NANOKV_CPU_ISA`` or the best for this CPU). Both
    kernel variables are checked here, so a bad value of either fails where the variant is
    chosen, before a model loads."""
    switched_off()
    return choose_variant(cpu_features(), os.environ.get(ISA_VARIABLE))


def find_compiler() -> str | None:
    """The C compiler the kernels are built with: ``$CC``, else cc, gcc or clang on PATH."""
    if explicit := os.environ.get("CC"):
        return shutil.which(explicit)
    return shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


@cache
def compiler_version(compiler: str) -> str:
    """The first line of ``compiler --version`` (part of a library's identity)."""
    try:
        result = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelBuildError(f"the C compiler {compiler} does not run ({e})") from None
    lines = (result.stdout or result.stderr).strip().splitlines()
    if result.returncode != 0 or not lines:
        raise KernelBuildError(f"the C compiler {compiler} does not run (--version failed)")
    return lines[0]


def sources() -> list[Path]:
    """The kernels' C sources and headers; a folder without them is a broken install."""
    found = sorted(SOURCE_DIR.glob("*.c")) + sorted(SOURCE_DIR.glob("*.h"))
    if not any(p.suffix == ".c" for p in found):
        raise KernelBuildError(
            f"nanokv's CPU kernel sources are missing from {SOURCE_DIR}: "
            "a broken install, reinstall nanokv"
        )
    return found


def library_path(variant: IsaVariant, compiler: str, header: str | None = None) -> Path:
    """Where ``variant``'s library built by ``compiler`` (against ``header``, by default
    ``contract.header()``) lives in the cache."""
    from .cache_dir import default_cache_dir

    digest = hashlib.sha256()
    for source in sources():
        digest.update(source.name.encode() + b"\0" + source.read_bytes() + b"\0")
    generated = contract.header() if header is None else header
    digest.update(contract.HEADER_NAME.encode() + b"\0" + generated.encode() + b"\0")
    features = sorted(variant.requires & cpu_features())
    identity = (
        platform.machine(),
        os.path.realpath(compiler),
        compiler_version(compiler),
        variant.flags,
        _COMMON_FLAGS,
        features,
    )
    digest.update(repr(identity).encode())
    return default_cache_dir() / "kernels" / f"nanokv-{variant.name}-{digest.hexdigest()[:16]}.so"


@cache
def load(variant_name: str, symbols: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The kernels library for a variant, exporting ``symbols``: the cached build, or a new one
    when there is none or the cached file is unusable."""
    return _load(next(v for v in VARIANTS if v.name == variant_name), symbols)[0]


def kernels(symbols: tuple[str, ...] = ()) -> Kernels:
    """The kernels as this process's settings ask for them now (callers keep the answer). A
    forced variant the CPU cannot run raises KernelVariantError; anything else that stops them
    (no compiler, no sources, a failed build) leaves ``lib`` None with the reason in
    ``missing``."""
    variant = active_variant()
    if switched_off():
        setting = f"{SWITCH_VARIABLE}={os.environ[SWITCH_VARIABLE]}"
        return Kernels(None, variant, None, False, setting, switched_off=True)
    try:
        lib, path, built = _load(variant, symbols)
    except (OSError, KernelBuildError, subprocess.SubprocessError) as e:
        return Kernels(None, variant, None, False, _missing_note(e))
    return Kernels(lib, variant, path, built, None)


def _missing_note(e: BaseException) -> str:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if isinstance(e, OSError) and e.strerror:
        first = f"{e.filename or ''}: {e.strerror}".lstrip(": ")
    return f"nanokv's C kernels are unavailable, so {TORCH_PATH_COST}: {first}"


def _load(variant: IsaVariant, symbols: tuple[str, ...]) -> tuple[ctypes.CDLL, Path, bool]:
    compiler = find_compiler()
    if compiler is None:
        where = (
            f"CC={os.environ['CC']!r} is not found"
            if os.environ.get("CC")
            else ("no cc, gcc or clang on PATH")
        )
        raise KernelBuildError(f"no C compiler ({where}): install gcc, or set CC to one")
    path = library_path(variant, compiler)
    if path.is_file():
        lib, _ = open_library(path, symbols, contract.contract_id())
        if lib is not None:
            return lib, path, False
        path.unlink(missing_ok=True)  # empty, truncated or foreign: rebuilt below
    return build_library(variant, compiler, path, symbols), path, True


def open_library(
    path: Path, symbols: tuple[str, ...], contract_id: str
) -> tuple[ctypes.CDLL | None, list[str]]:
    """``path`` loaded if it loads, exports every symbol and was built from the contract
    ``contract_id``, else None and what it lacks (unloaded, so that a rebuild at the same path
    is not served the old handle)."""
    try:
        lib = ctypes.CDLL(str(path))
    except OSError:
        return None, list(symbols)
    absent = [name for name in symbols if not hasattr(lib, name)]
    if not absent:
        reported = getattr(lib, contract.CONTRACT_SYMBOL, None)
        if reported is None:
            absent = [contract.CONTRACT_SYMBOL]
        else:
            reported.argtypes, reported.restype = [], ctypes.c_char_p
            if reported() == contract_id.encode():
                return lib, []
            absent = [f"contract {contract_id} (it was built from {reported().decode()!r})"]
    import _ctypes

    _ctypes.dlclose(lib._handle)
    return None, absent


def build_library(
    variant: IsaVariant,
    compiler: str,
    path: Path,
    symbols: tuple[str, ...],
    entries: tuple[contract.EntryPoint, ...] = contract.ENTRY_POINTS,
) -> ctypes.CDLL:
    """Compile ``variant``'s library into ``path`` against the header of ``entries`` (the
    contract table), loaded and checked."""
    path.parent.mkdir(parents=True, exist_ok=True)
    c_files = [str(s) for s in sources() if s.suffix == ".c"]
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        # Generated beside the build, never into the package (which may be read-only): the
        # sources find it on the include path.
        (Path(tmp) / contract.HEADER_NAME).write_text(contract.header(entries))
        built = Path(tmp) / path.name
        flags = [*variant.flags, *_COMMON_FLAGS, f"-I{tmp}"]
        command = [compiler, *flags, "-o", str(built), *c_files, "-lm"]
        result = subprocess.run(command, capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            lines = result.stderr.strip().splitlines() or ["no message"]
            first = next((line for line in lines if "error" in line), lines[0])
            raise KernelBuildError(
                f"the C compiler {compiler} rejected nanokv's CPU kernels ({variant.name}): "
                f"{first.strip()}\n" + result.stderr[-2000:]
            )
        # Loaded under its temporary name, checked, then moved into place (atomic: a
        # concurrent build just wins or loses): the cache never holds a library that fails.
        lib, absent = open_library(built, symbols, contract.contract_id(entries))
        if lib is None:
            raise KernelBuildError(
                f"the kernels built from {SOURCE_DIR} do not load or lack {', '.join(absent[:3])}"
            )
        os.replace(built, path)
        return lib
