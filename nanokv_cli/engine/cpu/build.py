"""Building and loading the CPU kernels (``csrc/*.c``): one shared library per instruction set.

The kernels are compiled with the system C compiler on first use, once per source version and
instruction-set variant, into nanokv's cache directory, and called through ctypes. Which
variant runs is decided at run time from what this CPU reports (``/proc/cpuinfo``), not from
the machine that built it, so a cache directory shared between an AVX2-only EPYC and an
AVX-512 Xeon holds one library for each and neither meets the other's code.

``NANOKV_CPU_ISA`` forces a variant (``generic``, ``avx2``, ``avx512``): that is how the test
suite runs the plain-C and AVX2 paths on an AVX-512 machine. Asking for a variant this CPU
cannot run is an error, not a silent fallback. ``NANOKV_CPU_KERNELS=0`` switches the kernels
off: every caller then stays on torch (and quantized formats are unavailable).
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

SOURCE_DIR = Path(__file__).with_name("csrc")
ISA_VARIABLE = "NANOKV_CPU_ISA"
SWITCH_VARIABLE = "NANOKV_CPU_KERNELS"


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


def choose_variant(features: frozenset[str], forced: str | None = None) -> IsaVariant:
    """The variant to run: ``forced`` (a name) if this CPU can run it, else the best it can."""
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    usable = [v for v in VARIANTS if v.name == "generic" or (x86 and v.requires <= features)]
    if forced is None or forced == "":
        return usable[0]
    names = [v.name for v in VARIANTS]
    if forced not in names:
        raise KernelBuildError(f"{ISA_VARIABLE}={forced!r}: choose one of {', '.join(names)}")
    for variant in usable:
        if variant.name == forced:
            return variant
    missing = sorted(next(v for v in VARIANTS if v.name == forced).requires - features)
    raise KernelBuildError(
        f"{ISA_VARIABLE}={forced}: this CPU lacks {', '.join(missing)}; "
        f"it can run {', '.join(v.name for v in usable)}"
    )


def active_variant() -> IsaVariant:
    """The variant this process runs (``NANOKV_CPU_ISA`` or the best for this CPU)."""
    return choose_variant(cpu_features(), os.environ.get(ISA_VARIABLE))


@cache
def load(variant_name: str) -> ctypes.CDLL:
    """The kernels library for a variant, built into the cache on first use."""
    variant = next(v for v in VARIANTS if v.name == variant_name)
    path = _library_path(variant)
    if not path.is_file():
        _build(variant, path)
    return ctypes.CDLL(str(path))


def library() -> ctypes.CDLL | None:
    """This process's kernels, or None where they are switched off or cannot be built (no
    compiler, no writable cache): callers then stay on torch. A forced variant the CPU cannot
    run raises KernelBuildError."""
    if os.environ.get(SWITCH_VARIABLE, "1") == "0":
        return None
    variant = active_variant()
    try:
        return load(variant.name)
    except (OSError, KernelBuildError, subprocess.SubprocessError):
        return None


def _sources() -> list[Path]:
    return sorted(SOURCE_DIR.glob("*.c")) + sorted(SOURCE_DIR.glob("*.h"))


def _library_path(variant: IsaVariant) -> Path:
    from ..loader import default_cache_dir

    digest = hashlib.sha256()
    for source in _sources():
        digest.update(source.name.encode() + b"\0" + source.read_bytes() + b"\0")
    digest.update(repr((platform.machine(), variant.flags, _COMMON_FLAGS)).encode())
    return default_cache_dir() / "kernels" / f"nanokv-{variant.name}-{digest.hexdigest()[:16]}.so"


def _build(variant: IsaVariant, path: Path) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise KernelBuildError("no C compiler (set CC, or install gcc)")
    path.parent.mkdir(parents=True, exist_ok=True)
    sources = [str(s) for s in sorted(SOURCE_DIR.glob("*.c"))]
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        built = Path(tmp) / path.name
        command = [compiler, *variant.flags, *_COMMON_FLAGS, "-o", str(built), *sources]
        result = subprocess.run([*command, "-lm"], capture_output=True, text=True, timeout=300)
        if result.returncode == 0:
            os.replace(built, path)  # atomic: a concurrent build just wins or loses
            return
        raise KernelBuildError(
            f"the C compiler rejected nanokv's CPU kernels ({variant.name}):\n"
            + result.stderr[-2000:]
        )
