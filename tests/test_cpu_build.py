"""The CPU kernels' instruction-set variants (``engine/cpu/build.py``): chosen at run time from
what the CPU reports, forced by ``NANOKV_CPU_ISA``, and every variant this machine can run
passes the kernel tests, so an AVX-512 machine checks the AVX2 and plain-C code too."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from nanokv_cli.engine.cpu import build

AVX2 = frozenset({"avx2", "fma", "f16c", "bmi2"})
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}
x86_only = pytest.mark.skipif(os.uname().machine not in ("x86_64", "AMD64"), reason="x86 variants")


@x86_only
def test_the_best_variant_the_cpu_runs_is_chosen():
    assert build.choose_variant(AVX512).name == "avx512"
    assert build.choose_variant(AVX2 | {"avx512f"}).name == "avx2"  # no VNNI: not the avx512 build
    assert build.choose_variant(frozenset({"sse2"})).name == "generic"


@x86_only
def test_a_forced_variant_runs_only_where_the_cpu_has_it():
    assert build.choose_variant(AVX512, "generic").name == "generic"
    assert build.choose_variant(AVX512, "avx2").name == "avx2"
    with pytest.raises(build.KernelBuildError, match="lacks avx512_vnni.*it can run avx2, generic"):
        build.choose_variant(AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}, "avx512")
    with pytest.raises(build.KernelBuildError, match="choose one of avx512, avx2, generic"):
        build.choose_variant(AVX512, "neon")


def test_each_variant_builds_its_own_library():
    compiler = build.find_compiler()
    paths = {v.name: build.library_path(v, compiler) for v in build.VARIANTS}
    assert len(set(paths.values())) == len(paths)  # never one file for two instruction sets


def test_another_compiler_builds_another_library(tmp_path):
    # A compiler that reports another version (an upgraded gcc, a clang) must not be served
    # the library of the old one.
    other = tmp_path / "cc"
    other.write_text("#!/bin/sh\necho 'othercc 99.1'\n")
    other.chmod(0o755)
    variant = build.VARIANTS[-1]
    assert build.library_path(variant, str(other)) != build.library_path(
        variant, build.find_compiler()
    )


def runnable_variants() -> list[str]:
    features = build.cpu_features()
    names = []
    for variant in build.VARIANTS:
        try:
            build.choose_variant(features, variant.name)
        except build.KernelBuildError:
            continue
        names.append(variant.name)
    return names


@pytest.mark.slow
@pytest.mark.parametrize("variant", [v.name for v in build.VARIANTS])
def test_the_kernel_tests_pass_under_every_variant(variant):
    if variant not in runnable_variants():
        pytest.skip(f"this CPU cannot run the {variant} build")
    if variant == build.active_variant().name:
        pytest.skip("the rest of the suite runs this variant")
    env = {**os.environ, build.ISA_VARIABLE: variant}
    # It must build: without a library the kernel tests would skip and prove nothing.
    probe = "from nanokv_cli.engine.cpu import kernels; assert kernels.available()"
    subprocess.run([sys.executable, "-c", probe], env=env, check=True, timeout=600)
    tests = Path(__file__).parent
    files = ["test_cpu_kernels.py", "test_cpu_formats.py", "test_cpu_pool.py", "test_quant.py"]
    # Of the model-level checks, the default model's KL and greedy-agreement bounds, decode
    # and prompts, in every mode; the batch-invariance checks run per variant in
    # test_answer_invariance.py (the whole file took 140 s of plain C).
    bounds = [
        "test_quantized_model.py::test_default_model_stays_close_to_float",
        "test_quantized_model.py::test_auto_prompts_stay_close_to_float",
    ]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-p", "no:cacheprovider"]
        + [str(tests / f) for f in [*files, *bounds]],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert " passed" in result.stdout
